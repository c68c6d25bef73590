#!/usr/bin/env bash
# The whole test suite: formatting and lints, unit tests and end-to-end
# tests on real KVM. Arguments go to `cargo test`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh

# Style and lints are part of the suite: CI fails on a formatting diff or
# on any clippy warning, in the host workspace and in the guest workspace.
cargo fmt --all --check
(cd guest && cargo fmt --check)
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
(cd guest && cargo clippy --release --target x86_64-unknown-linux-gnu --all-targets --quiet -- -D warnings)

cargo test --release --workspace "$@"
