#!/usr/bin/env bash
# The main job, for now: run the memtouch guest on 2 vCPUs, snapshot it in
# the middle of its run, restore the snapshot in a new VMM process, and show
# that the restored VM finishes with the same memory checksum as an
# uninterrupted run. (Replication and failover replace this demo when they
# land.)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh

ftvm=target/release/ftvm
image=target/images/memtouch.elf
cmdline="ws=64M pattern=hotcold vcpus=2 writes=200000000 report=250ms"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== 1. uninterrupted run: memtouch $cmdline"
"$ftvm" run --image "$image" --vcpus 2 --cmdline "$cmdline" | tee "$work/plain.out"

echo
echo "== 2. the same run, snapshotted after 1 s and stopped"
"$ftvm" run --image "$image" --vcpus 2 --cmdline "$cmdline" --api-socket "$work/api.sock" >"$work/first.out" &
vmm=$!
for _ in $(seq 100); do [ -S "$work/api.sock" ] && break; sleep 0.05; done
sleep 1
"$ftvm" snapshot --api-socket "$work/api.sock" --output "$work/vm.snap" --stop
wait "$vmm"
cat "$work/first.out"

echo
echo "== 3. restored in a new process"
"$ftvm" restore --snapshot "$work/vm.snap" | tee "$work/restored.out"

plain=$(grep -o 'checksum=[0-9a-f]*' "$work/plain.out")
restored=$(grep -o 'checksum=[0-9a-f]*' "$work/restored.out")
echo
if [ "$plain" = "$restored" ]; then
    echo "OK: the restored VM finished with the uninterrupted run's $plain"
else
    echo "MISMATCH: uninterrupted $plain, restored $restored" >&2
    exit 1
fi
