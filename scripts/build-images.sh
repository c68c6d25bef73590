#!/usr/bin/env bash
# Build the guest programs (guest/ workspace) and copy them to
# target/images/NAME.elf, where the VMM and its tests look for them; the
# runtime's Linux personality is linux.elf. The static C test programs of
# the Linux personality (guest/linux/programs/NAME.c) become
# target/images/linux-NAME (musl-gcc, from Debian's musl-tools), and the
# dynamically linked ones (guest/linux/programs/dynamic/NAME.c, glibc, PIE)
# target/images/linux-NAME too (gcc; run them with a root file system from
# scripts/make-rootfs.sh). Idempotent;
# runs from any directory.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target=x86_64-unknown-linux-gnu
apps=(memtouch probe netprobe kv linux)

# From inside guest/ so its .cargo/config.toml (static, no-libc link flags)
# applies; the explicit --target keeps those flags off build scripts.
bins=()
for app in "${apps[@]}"; do bins+=(--bin "$app"); done
cd "$root/guest"
cargo build --release --target "$target" "${bins[@]}"

out="$root/target/images"
mkdir -p "$out"
for app in "${apps[@]}"; do
    cp "$root/guest/target/$target/release/$app" "$out/$app.elf.tmp"
    mv "$out/$app.elf.tmp" "$out/$app.elf"
    echo "built $out/$app.elf ($(stat -c %s "$out/$app.elf") bytes)"
done

# Build C program SRC into $out/NAME with COMPILER and FLAGS..., only when the
# source is newer than the binary.
build_c() {
    local name=$1 src=$2
    shift 2
    if [ ! -e "$out/$name" ] || [ "$src" -nt "$out/$name" ]; then
        "$@" -O2 -Wall -Werror -o "$out/$name.tmp" "$src"
        mv "$out/$name.tmp" "$out/$name"
        echo "built $out/$name ($(stat -c %s "$out/$name") bytes)"
    fi
}

# Unmodified static Linux programs (no ftvm ABI note).
command -v musl-gcc >/dev/null || { echo "build-images: musl-gcc not found (install musl-tools: scripts/setup.sh)" >&2; exit 1; }
for src in "$root"/guest/linux/programs/*.c; do
    build_c "linux-$(basename "$src" .c)" "$src" musl-gcc -static
done

# hello.c as a glibc static-pie too: position-independent without an
# interpreter, also loaded by the personality from a root file system.
build_c linux-hello-static-pie "$root/guest/linux/programs/hello.c" gcc -static-pie

# Dynamically linked glibc programs (PIE), loaded by the personality itself
# with their interpreter and libraries from a root file system.
for src in "$root"/guest/linux/programs/dynamic/*.c; do
    build_c "linux-$(basename "$src" .c)" "$src" gcc -fPIE -pie
done
