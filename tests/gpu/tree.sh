#!/usr/bin/env bash
# What travels to a GPU machine is the working tree (tracked files and untracked ones git
# does not ignore) plus what a run carries, at most 64 MiB; the committed weights alone are
# ~90 MB, and the GPU check makes its own tiny models. So, for a GPU run:
#   tests/gpu/tree.sh cut       untrack the weights in the index only, and ignore them
#   tests/gpu/tree.sh size      MiB that would travel (the tree and .gpu/, carried)
#   tests/gpu/tree.sh restore   track them again (the files never leave the disk)
# Commit nothing between cut and restore.
set -euo pipefail
cd "$(dirname "$0")/../.."
MARK="# weights untracked for a GPU run (tests/gpu/tree.sh)"
exclude=.git/info/exclude
weights() { git ls-files -- '*.safetensors'; }
case "${1:-size}" in
cut)
    mapfile -t paths < <(weights)
    [ ${#paths[@]} = 0 ] && { echo "already cut"; exit 0; }
    git rm -q --cached -- "${paths[@]}"
    { echo "$MARK"; printf '/%s\n' "${paths[@]}"; echo "$MARK end"; } >> "$exclude"
    echo "untracked ${#paths[@]} weight files"
    ;;
restore)
    awk -v mark="$MARK" '$0 == mark { skip = 1 } !skip { print } $0 == mark " end" { skip = 0 }' \
        "$exclude" > "$exclude.new" && mv "$exclude.new" "$exclude"
    git reset -q -- '*.safetensors'
    echo "tracked again: $(weights | wc -l) weight files"
    ;;
size)
    { git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | xargs -0 -r stat -c %s 2>/dev/null | awk -v extra="$(du -sb .gpu 2>/dev/null | cut -f1)" \
        '{ s += $1 } END { printf "tree %.1f MiB, .gpu %.1f MiB, together %.1f MiB (limit 64)\n",
           s / 2^20, extra / 2^20, (s + extra) / 2^20 }'
    ;;
*) echo "usage: $0 cut|size|restore" >&2; exit 2 ;;
esac
