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

# The guest's plain data structures, on the host: without the guest's
# link flags (RUSTFLAGS set, even empty, replaces them) and in a target
# directory of their own so that the guest build is not redone each time.
(cd guest && RUSTFLAGS= cargo test --release --quiet -p ftvm-linux --lib --target x86_64-unknown-linux-gnu --target-dir target/host)

cargo test --release --workspace "$@"
