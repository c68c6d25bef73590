#!/usr/bin/env bash
# Collect a dynamically linked program, its interpreter and the libraries
# ldd lists (and any more host files named after DIR) into DIR, each at its
# host path (symbolic links resolved), for `ftvm run --rootfs DIR --image
# PROGRAM`. Idempotent: files already there are replaced.
#
#   scripts/make-rootfs.sh PROGRAM DIR [FILE...]
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: make-rootfs.sh PROGRAM DIR [FILE...]" >&2
    exit 2
fi
program="$1"
dir="$2"
shift 2
[ -f "$program" ] || { echo "make-rootfs: $program: no such file" >&2; exit 1; }
command -v ldd >/dev/null || { echo "make-rootfs: ldd not found (libc-bin)" >&2; exit 1; }

# ldd prints "name => /path (addr)" for a library and "/path (addr)" for the
# interpreter; a static program has neither.
libs=()
if out="$(ldd "$program" 2>/dev/null)"; then
    while read -r path; do
        libs+=("$path")
    done < <(printf '%s\n' "$out" | sed -n -e 's/.*=> \(\/[^ ]*\) (.*/\1/p' -e 's/^[[:space:]]*\(\/[^ ]*\) (.*/\1/p')
fi

copy() {
    local src="$1" dst
    dst="$dir/$(realpath -s "$src")"
    mkdir -p "$(dirname "$dst")"
    cp -L --preserve=mode "$src" "$dst.tmp"
    mv "$dst.tmp" "$dst"
}

mkdir -p "$dir"
copy "$program"
for f in "${libs[@]}" "$@"; do
    [ -e "$f" ] || { echo "make-rootfs: $f: no such file" >&2; exit 1; }
    copy "$f"
done
echo "make-rootfs: $dir: $(find "$dir" -type f | wc -l) files, $(du -sh "$dir" | cut -f1)"
