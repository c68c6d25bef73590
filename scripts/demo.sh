#!/usr/bin/env bash
# The main job: a replicated Redis-protocol VM survives the death of its
# host. `ftvm demo` builds a private network from namespaces (a client, two
# hosts, a replication link), runs the kv guest on h1 checkpointing every
# 20 ms to a backup on h2, loads it with redis-benchmark and with writers
# that record every acknowledged write, kills h1 (links cut, VMM SIGKILLed),
# and checks that the backup, now serving, has every acknowledged write.
# Needs root. Extra arguments go to `ftvm demo` (--trials N, --epoch-ms N,
# --seconds S).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh

exec target/release/ftvm demo "$@"
