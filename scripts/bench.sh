#!/usr/bin/env bash
# Benchmarks (not tests): print tables, write CSV and SVG into target/bench.
# Usage: scripts/bench.sh [vm] [ftvm-bench options]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
what="${1:-vm}"
shift || true
target/release/ftvm-bench "$what" "$@"
