#!/usr/bin/env bash
# Where a running guest's vCPU spends its time, by guest function.
#
#   scripts/perf-guest.sh PID SECONDS IMAGE...
#
# PID is a running `ftvm run`; IMAGEs are the ELF files its guest runs (for
# a Linux program: target/images/linux.elf and the program). perf on the
# host samples the vCPU thread; samples taken while the guest ran carry the
# guest's instruction pointer (perf's "guest user" mode, misc 0x5 in
# `perf report -D`), which this resolves against the images' symbols.
# Samples in the host kernel (exits, the wait hypercall) are listed by perf
# symbol; addresses above the guest's (the hypervisor's own switching code)
# are counted as "hypervisor".
set -euo pipefail

[ $# -ge 3 ] || { echo "usage: $0 PID SECONDS IMAGE..." >&2; exit 2; }
pid=$1 seconds=$2
shift 2
vcpu=$(grep -lx 'vcpu0' /proc/"$pid"/task/*/comm | head -1 | cut -d/ -f5)
[ -n "$vcpu" ] || { echo "perf-guest: no vcpu0 thread in process $pid" >&2; exit 1; }
data=$(mktemp)
trap 'rm -f "$data"' EXIT
perf record -q -t "$vcpu" -o "$data" -- sleep "$seconds" 2>/dev/null
echo "host side of the vCPU thread (exits, waits), % of all samples:"
perf report -i "$data" --no-children --sort sym 2>/dev/null | grep -v '^#' | grep -v '^$' | head -8
echo
echo "guest side, by function (% of guest samples):"
perf report -i "$data" -D 2>/dev/null | awk '/PERF_RECORD_SAMPLE\(IP, 0x5\)/ {print $7}' \
    | sort | uniq -c | sort -rn | head -400 \
    | while read -r count ip; do printf '%s 0x%016x\n' "$count" "$((ip))"; done > "$data.ips"
total=$(awk '{n += $1} END {print n + 0}' "$data.ips")
[ "$total" -gt 0 ] || { echo "no guest samples"; exit 0; }
# Each address's outermost function (inlined code counts for its caller),
# from the first image that knows it; one addr2line run per image.
names=$(mktemp)
trap 'rm -f "$data" "$data.ips" "$names"' EXIT
for image in "$@"; do
    awk '{print $2}' "$data.ips" | addr2line -a -f -C -i -e "$image" \
        | awk 'function flush() { if (addr != "" && fn != "??") print addr, fn } /^0x/ {flush(); addr = $0; fn = ""; odd = 1; next} {if (odd) fn = $0; odd = !odd} END {flush()}' >> "$names"
done
awk -v total="$total" -v names="$names" '
    BEGIN { while ((getline line < names) > 0) { a = line; sub(/ .*/, "", a); f = line; sub(/^[^ ]* /, "", f); if (!(a in fn)) fn[a] = f } }
    { name = ($2 !~ /^0x000000/) ? "hypervisor" : (($2 in fn) ? fn[$2] : "?"); sum[name] += $1 }
    END { for (n in sum) printf "%5.1f%% %s\n", 100 * sum[n] / total, n }' "$data.ips" | sort -rn | head -40
