#!/usr/bin/env bash
# Build the guest programs (guest/ workspace) and copy them to
# target/images/NAME.elf, where the VMM and its tests look for them.
# Idempotent; runs from any directory.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target=x86_64-unknown-linux-gnu
apps=(memtouch probe netprobe kv)

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
