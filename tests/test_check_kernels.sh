#!/bin/sh
# scripts/check_kernels.py finds a kernel whose first statement is not ekv_grid_begin() or
# ekv_grid_begin_with(...) (one that waits too late, one that never does, one declared over
# several lines, one that reads before ekv_grid_begin_with) and passes the others.
CHECK="$1"
PY="${2:-python3}"
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
cat > "$DIR/good.cu" <<'CU'
/* __global__ void in_a_comment(int a) { } */
template <int N> __global__ void __launch_bounds__(128, 2) good_kernel(int a) {
    ekv_grid_begin(); // first
    extern __shared__ float s[];
}
__global__ void declared_only(int a);
__global__ void held_kernel(const float *w) {
    const row_t h = ekv_grid_begin_with([&] { return load(w); });
}
CU
cat > "$DIR/bad.cu" <<'CU'
__global__ void late_kernel(int *p) {
    p[0] = 1;
    ekv_grid_begin();
}
__global__ void
        never_kernel(const int *a,
                     int b) {
    (void)a;
}
__global__ void early_read_kernel(const float *w) {
    const float x = w[0];
    const row_t h = ekv_grid_begin_with([&] { return load(w); });
}
CU
OUT=$("$PY" "$CHECK" "$DIR")
RC=$?
FAIL=0
[ "$RC" -eq 1 ] || { echo "FAIL: exit $RC, want 1"; FAIL=1; }
for k in late_kernel never_kernel early_read_kernel; do
    echo "$OUT" | grep -q "bad.cu:.*$k" || { echo "FAIL: $k not reported: $OUT"; FAIL=1; }
done
echo "$OUT" | grep -q "good" && { echo "FAIL: a good kernel reported: $OUT"; FAIL=1; }
[ "$(echo "$OUT" | grep -c .)" -eq 3 ] || { echo "FAIL: want 3 lines: $OUT"; FAIL=1; }
rm -f "$DIR/bad.cu"
"$PY" "$CHECK" "$DIR" > /dev/null || { echo "FAIL: the good file alone fails"; FAIL=1; }
[ "$FAIL" -eq 0 ] && echo "check_kernels: every check passed"
exit "$FAIL"
