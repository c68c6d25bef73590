#!/usr/bin/env bash
# The whole test suite: unit tests and end-to-end tests on real KVM.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
cargo test --release --workspace "$@"
