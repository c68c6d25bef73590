#!/usr/bin/env bash
# Everything a fresh machine needs before ftvm can run: checks the host,
# builds the VMM and the guest images. Idempotent; runs from any directory.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

command -v cargo >/dev/null || { echo "setup: cargo not found: install Rust (rustup)" >&2; exit 1; }
[ -e /dev/kvm ] || echo "setup: warning: /dev/kvm is missing; VMs cannot run on this host" >&2

cargo build --release --workspace --quiet
scripts/build-images.sh
