#!/usr/bin/env bash
# Checks that the C listing in README.md's "Library" section is taken from
# examples/quickstart.c: every line of it but the #include must be a line of the program, so
# the README cannot drift from the code CTest runs.
#   examples/check_readme.sh README.md examples/quickstart.c
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -eq 2 ] || { echo "usage: $0 README.md quickstart.c" >&2; exit 2; }
listing=$(awk '/^## Library/ { sec = 1; next } /^## / { sec = 0 }
               sec && /^```c/ { code = 1; next } code && /^```/ { exit } code' "$1")
[ -n "$listing" ] || { echo "check_readme: no C listing in the Library section of $1" >&2; exit 1; }
bad=0
while IFS= read -r line; do
  case "$line" in "" | "#include"*) continue ;; esac
  grep -Fxq -- "$line" "$2" || { echo "check_readme: not in $2: $line" >&2; bad=1; }
done <<<"$listing"
exit "$bad"
