#!/bin/sh
# scripts/check_kernels.py finds a kernel whose first statement is not ekv_grid_begin() (one that
# waits too late, one that never does, one declared over several lines) and passes the others.
CHECK="$1"
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
cat > "$DIR/good.cu" <<'CU'
/* __global__ void in_a_comment(int a) { } */
template <int N> __global__ void __launch_bounds__(128, 2) good_kernel(int a) {
    ekv_grid_begin(); // first
    extern __shared__ float s[];
}
__global__ void declared_only(int a);
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
CU
OUT=$(python3 "$CHECK" "$DIR")
RC=$?
FAIL=0
[ "$RC" -eq 1 ] || { echo "FAIL: exit $RC, want 1"; FAIL=1; }
for k in late_kernel never_kernel; do
    echo "$OUT" | grep -q "bad.cu:.*$k" || { echo "FAIL: $k not reported: $OUT"; FAIL=1; }
done
echo "$OUT" | grep -q "good" && { echo "FAIL: a good kernel reported: $OUT"; FAIL=1; }
[ "$(echo "$OUT" | grep -c .)" -eq 2 ] || { echo "FAIL: want 2 lines: $OUT"; FAIL=1; }
rm -f "$DIR/bad.cu"
python3 "$CHECK" "$DIR" > /dev/null || { echo "FAIL: the good file alone fails"; FAIL=1; }
[ "$FAIL" -eq 0 ] && echo "check_kernels: 5 checks passed"
exit "$FAIL"
