#!/usr/bin/env bash
# Checks that every citation of the docs in the repository points at something that exists:
#   docs/math.md §X.Y[-N | -X.Z]   a "## X." / "### X.Y" heading (and, for -N, item N of the
#                                  section's numbered list);
#   docs/architecture.md, "Title"  a "## Title" heading;
# and that nothing cites documents outside the repository (a parent "shared" folder, "SPEC x.y",
# "DESIGN n"). Usage: docs/check_refs.sh [REPO_ROOT]. Exit 0 = all resolve, 1 = not.
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"
math=docs/math.md arch=docs/architecture.md
fail=0
files=$(git ls-files -co --exclude-standard -- '*.c' '*.h' '*.cu' '*.cuh' '*.py' '*.sh' '*.md' \
        '*.txt' '*.cmake' '*.in' 2>/dev/null | grep -v '^docs/check_refs.sh$' || true)
[ -n "$files" ] || { echo "check_refs: no files found under $root" >&2; exit 1; }

has_section() { # X or X.Y
  if [[ $1 == *.* ]]; then grep -q "^### $1 " "$math"; else grep -q "^## $1\. " "$math"; fi
}
has_item() { # section X.Y, item N: a line "N. " between its heading and the next heading
  awk -v sec="### $1 " -v item="$2" '
    index($0, sec) == 1 { on = 1; next }
    on && /^##/ { exit }
    on && index($0, item ". ") == 1 { found = 1 }
    END { exit !found }' "$math"
}

# shellcheck disable=SC2086
while IFS= read -r cite; do
  ref=${cite#*§}
  base=${ref%%-*} tail=""
  [[ $ref == *-* ]] && tail=${ref#*-}
  ok=1
  has_section "$base" || ok=0
  if [ -n "$tail" ] && [ $ok = 1 ]; then
    if [[ $tail == *.* ]]; then has_section "$tail" || ok=0; else has_item "$base" "$tail" || ok=0; fi
  fi
  [ $ok = 1 ] || { echo "unresolved: docs/math.md §$ref"; fail=1; }
done < <(grep -ohE 'docs/math\.md §[0-9]+(\.[0-9]+)?(-[0-9]+(\.[0-9]+)?)?' $files | sort -u)

while IFS= read -r title; do
  grep -qxF "## $title" "$arch" || { echo "unresolved: docs/architecture.md, \"$title\""; fail=1; }
done < <(grep -ohE 'docs/architecture\.md,[[:space:]]*"[^"]+"' $files | sed -E 's/.*"([^"]+)"/\1/' | sort -u)

up_shared='\.\./'"shared/" # spelled apart so that this file does not match itself
if outside=$(grep -nE "$up_shared"'|\bSPEC [0-9]|\bDESIGN [0-9]|\bBENCH\.md\b' $files); then
  echo "citations of documents outside the repository:"
  echo "$outside"
  fail=1
fi
[ $fail = 0 ] && echo "check_refs: every docs citation resolves"
exit $fail
