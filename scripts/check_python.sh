#!/usr/bin/env bash
# The Python package as a new user gets it: a fresh virtualenv, `pip install .` (the README's
# command; it builds the C library with CMake into the package, with the CUDA backend when nvcc
# is found), the README's Python listing run as written, then the package's tests (numpy; the
# torch and GPU paths are tested on the GPU machine), with python/tests/test_serve.py driving
# `entmaxkv serve` through the `openai` client: the CLI of build-test/ (scripts/test.sh's; built
# here when missing) or $ENTMAXKV_CLI. Needs python3 with venv and PyPI access.
# Usage: scripts/check_python.sh
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(mktemp -d /tmp/ekv-venv.XXXXXX)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv" || {
  echo "check_python: python3 -m venv failed (on Debian: apt-get install python3-venv)" >&2
  exit 1
}
"$venv/bin/pip" install -q "$repo" pytest openai
cli=${ENTMAXKV_CLI:-$repo/build-test/entmaxkv}
if [ ! -x "$cli" ]; then # the server the serve test drives: scripts/test.sh's build directory
  . "$repo/scripts/deps.sh"
  ekv_need_tools
  cmake -S "$repo" -B "$repo/build-test" -DEKV_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$repo/build-test" -j"$(nproc)" --target entmaxkv_cli
fi
export ENTMAXKV_CLI=$cli
listing=$(awk '/^## Python/ { sec = 1; next } /^## / { sec = 0 }
               sec && /^```python/ { code = 1; next } code && /^```/ { exit } code' "$repo/README.md")
[ -n "$listing" ] || { echo "check_python: no Python listing in README.md's Python section" >&2; exit 1; }
cd "$venv" # away from the source tree: the installed package is what is imported
echo "-- the README's Python listing"
"$venv/bin/python" -c "$listing"
echo "-- examples/python/decode_paged.py"
"$venv/bin/python" "$repo/examples/python/decode_paged.py"
echo "-- python/tests"
"$venv/bin/python" -m pytest -q "$repo/python/tests"
