#!/usr/bin/env bash
# The main job: a replicated Redis-protocol VM survives the death of its
# host, and a stalled primary is fenced. `ftvm demo` builds a private
# network from namespaces (a client, two hosts, a replication link), starts
# an etcd arbiter and writes a shared secret, runs the kv guest on h1
# checkpointing to a backup on h2 whenever it has output waiting and is
# idle (at most every 20 ms; both with --arbiter and
# --secret-file), loads it with redis-benchmark and with writers that record
# every acknowledged write, then (1) kills h1 (links cut, VMM SIGKILLed) and
# (2), with a fresh pair, SIGSTOPs the primary for about a second, links up:
# the backup takes over and the resumed old primary stops with "lost
# ownership of the VM". After each it checks that the new primary has every
# acknowledged write. Needs root. Extra arguments go to `ftvm demo`
# (--trials N, --epoch-ms N, --seconds S).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh

exec target/release/ftvm demo "$@"
