#!/usr/bin/env bash
# A prompt of N bytes from the repository's own text (docs, training notes, sources: text the
# shipped model never trained on). Sourced by the GPU benchmarks (bench/model_gpu.sh,
# bench/real_attention.sh), run from the repository root.
# Usage: . bench/repo_prompt.sh; prompt N   (prints the file's path; files live in $OUT)
# PROMPT_CORPUS=FILE takes the text from FILE instead of the tree: the real-attention numbers
# depend on the bytes (the supports and the flat heads do), and the tree's text changes with
# every commit, so runs of two trees compare on one corpus (e.g. the text of a pinned commit:
# git archive REV docs train src include | tar -x -C DIR, then the same files from DIR).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then # run, not sourced: only --help means something
  case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
fi
prompt() {
    local n=$1 f="$OUT/prompt_$1.txt"
    [ -s "$f" ] && { echo "$f"; return; }
    if [ -n "${PROMPT_CORPUS:-}" ]; then
        cp "$PROMPT_CORPUS" "$OUT/corpus.txt" || return 1
    else
        cat docs/*.md train/*.md src/*/*.c src/*/*.cu include/entmaxkv/*.h >"$OUT/corpus.txt"
    fi
    while [ "$(stat -c %s "$OUT/corpus.txt")" -lt "$n" ]; do
        cat "$OUT/corpus.txt" "$OUT/corpus.txt" >"$OUT/corpus2.txt" && mv "$OUT/corpus2.txt" "$OUT/corpus.txt"
    done
    head -c "$n" "$OUT/corpus.txt" >"$f"
    echo "$f"
}
