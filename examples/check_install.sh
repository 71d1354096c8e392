#!/usr/bin/env bash
# Checks an installed entmaxkv as a user meets it (CI runs it on a static and a shared
# install): builds and runs the examples with pkg-config and with find_package from a
# separate project, and runs the installed CLI from elsewhere, where it must find the
# installed model (also after the prefix is moved: RPATH and data dir are relative).
#   examples/check_install.sh PREFIX
set -euo pipefail
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -eq 1 ] || { usage >&2; exit 2; }
prefix=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/ekv-check-install.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "check_install: $*" >&2; exit 1; }
# lib, lib64 or lib/<multiarch>, as GNUInstallDirs chose: where entmaxkv.pc was installed
pc=$(find "$prefix" -name entmaxkv.pc -path '*/pkgconfig/*' | head -n 1)
[ -n "$pc" ] || fail "no entmaxkv.pc under $prefix"
export PKG_CONFIG_PATH; PKG_CONFIG_PATH=$(dirname "$pc")
# the shared library is found through the loader path, as a user without an rpath would
export LD_LIBRARY_PATH; LD_LIBRARY_PATH="$(dirname "$PKG_CONFIG_PATH")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

echo "-- pkg-config: $(pkg-config --cflags --libs entmaxkv)"
for ex in quickstart topk_delta certified; do
  # quickstart calls nothing from libm, so it links with pkg-config's flags alone: a static
  # libentmaxkv whose dependencies entmaxkv.pc leaves out fails here. topk_delta and
  # certified call sqrt themselves, so they add -lm as any such program must.
  extra=(); [ "$ex" = quickstart ] || extra=(-lm)
  # shellcheck disable=SC2046 # pkg-config's output is a list of flags
  cc -std=c11 -O2 -Wall -Wextra -Werror "$src/$ex.c" \
    $(pkg-config --cflags --libs entmaxkv) "${extra[@]}" -o "$work/$ex"
  "$work/$ex" >"$work/$ex.out" || fail "$ex (pkg-config build) failed: $(cat "$work/$ex.out")"
done
echo "-- pkg-config builds of quickstart, topk_delta, certified ran"

cmake -S "$src/cmake-consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" >/dev/null
cmake --build "$work/consumer" >/dev/null
for ex in quickstart topk_delta certified; do
  "$work/consumer/$ex" >/dev/null || fail "$ex (find_package build) failed"
done
echo "-- find_package(entmaxkv) builds ran"

unset LD_LIBRARY_PATH # the CLI must start through its own RPATH
cd "$work"
"$prefix/bin/entmaxkv" run -n 8 --prompt "The LORD" >/dev/null 2>"$work/run.err" ||
  fail "installed CLI could not run the installed model: $(cat "$work/run.err")"
# A moved prefix must use its own model, before the configured prefix and the source tree:
# give the moved copy a broken model and expect the load to fail on exactly that file.
cp -a "$prefix" "$work/moved"
echo "not a model" >"$work/moved/share/entmaxkv/entmaxkv-lm.safetensors"
if "$work/moved/bin/entmaxkv" run -n 1 >/dev/null 2>"$work/moved.err"; then
  fail "the moved CLI did not look in its own prefix first"
fi
grep -q "$work/moved/bin/../share/entmaxkv/entmaxkv-lm.safetensors" "$work/moved.err" ||
  fail "the moved CLI failed for another reason: $(cat "$work/moved.err")"
ENTMAXKV_MODEL="$work/none.safetensors" "$prefix/bin/entmaxkv" run -n 1 >/dev/null 2>"$work/env.err" &&
  fail "ENTMAXKV_MODEL naming a missing file was not used"
grep -q "$work/none.safetensors" "$work/env.err" || fail "ENTMAXKV_MODEL not used: $(cat "$work/env.err")"
echo "-- installed CLI: runs from $work, finds the model of a moved prefix, honours ENTMAXKV_MODEL"
