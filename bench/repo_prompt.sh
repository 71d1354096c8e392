#!/usr/bin/env bash
# A prompt of N bytes from the repository's own text (docs, training notes, sources: text the
# shipped model never trained on; decode speed does not depend on the bytes). Sourced by the
# GPU benchmarks (bench/model_gpu.sh, bench/real_attention.sh), run from the repository root.
# Usage: . bench/repo_prompt.sh; prompt N   (prints the file's path; files live in $OUT)
if [ "${BASH_SOURCE[0]}" = "$0" ]; then # run, not sourced: only --help means something
  case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
fi
prompt() {
    local n=$1 f="$OUT/prompt_$1.txt"
    [ -s "$f" ] && { echo "$f"; return; }
    cat docs/*.md train/*.md src/*/*.c src/*/*.cu include/entmaxkv/*.h >"$OUT/corpus.txt"
    while [ "$(stat -c %s "$OUT/corpus.txt")" -lt "$n" ]; do
        cat "$OUT/corpus.txt" "$OUT/corpus.txt" >"$OUT/corpus2.txt" && mv "$OUT/corpus2.txt" "$OUT/corpus.txt"
    done
    head -c "$n" "$OUT/corpus.txt" >"$f"
    echo "$f"
}
