#!/usr/bin/env bash
# Checks that the library reads no environment variables: no getenv, secure_getenv or environ
# in the C, CUDA and header files of src/. Its tunables are parameters
# (docs/architecture.md, "Errors and validation"). Prints each use found; CTest runs it (no_env).
# Usage: scripts/check_no_env.sh [SRC_DIR]   (default: the src/ beside this script).
# Exit 0 = none, 1 = some, 2 = no sources found.
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
src=${1:-$(cd "$(dirname "$0")/../src" && pwd)}
n=$(find "$src" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | wc -l)
[ "$n" -gt 0 ] || { echo "check_no_env: no C, CUDA or header files under $src" >&2; exit 2; }
if grep -rnE --include='*.c' --include='*.h' --include='*.cu' --include='*.cuh' \
     '\b(secure_)?getenv\b|\b_?environ\b' "$src"; then
  echo "check_no_env: the library reads the environment (above): make it a parameter" >&2
  exit 1
fi
echo "check_no_env: $n files under $src, no environment read"
