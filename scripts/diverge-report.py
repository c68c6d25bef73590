#!/usr/bin/env python3
"""Sum up a VSMR secondary's FTVM_DIVERGE_DUMP file (src/vsmr/src/diverge_dump.rs).

    scripts/diverge-report.py DUMP [--image target/images/kv.elf] [--vcpus 1] [--top 30]

Per syncvm: pages compared (the union), pages that differed, 64-byte blocks
that differed; by region of the guest's memory (system area, the image's
loaded segments with the nearest symbol, the vCPU stacks, the heap); the
pages that differed most often; and, for TCP sockets of the guest's smoltcp
stack (found by their local endpoint, 10.0.0.2:6379 by default), the
difference in the bytes received from the peer (positive: this replica,
the secondary, had taken more of the input than the leader).
"""

import argparse
import bisect
import collections
import struct
import subprocess

PAGE = 4096
BLOCK = 64
SYSTEM_AREA_END = 0x20_0000
CLOCK_PAGE = 0x8000
STACK_SIZE = 0x10_0000


def records(data):
    """Yield (union, [(page, mask, [(mine, leader)])]) per syncvm."""
    i = 0
    while i < len(data):
        if data[i:i + 2] != b"SY":
            raise SystemExit(f"corrupt dump at byte {i}")
        union, n = struct.unpack_from("<QQ", data, i + 2)
        i += 18
        pages = []
        for _ in range(n):
            if data[i:i + 2] != b"PG":
                raise SystemExit(f"corrupt page record at byte {i}")
            page, mask = struct.unpack_from("<QQ", data, i + 2)
            i += 18
            blocks = []
            for b in range(PAGE // BLOCK):
                if mask >> b & 1:
                    blocks.append((b, data[i:i + BLOCK], data[i + BLOCK:i + 2 * BLOCK]))
                    i += 2 * BLOCK
            pages.append((page, mask, blocks))
        yield union, pages


def image_layout(path):
    """(end of the loaded image, sorted [(address, symbol)])."""
    end = 0
    out = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "LOAD":
            end = max(end, int(f[2], 16) + int(f[5], 16))
    syms = []
    out = subprocess.run(["nm", "-n", "-C", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        f = line.split(maxsplit=2)
        if len(f) == 3 and f[1] in "bBdDrR":
            syms.append((int(f[0], 16), f[2]))
    return (end + PAGE - 1) // PAGE * PAGE, syms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump")
    ap.add_argument("--image", default="target/images/kv.elf")
    ap.add_argument("--vcpus", type=int, default=1)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--endpoint", default="10.0.0.2:6379", help="the guest's TCP endpoint, to find its sockets")
    a = ap.parse_args()
    image_end, syms = image_layout(a.image)
    sym_addrs = [s[0] for s in syms]
    stacks_end = image_end + a.vcpus * STACK_SIZE

    def region(addr):
        if addr == CLOCK_PAGE:
            return "clock page (the VMM's)"
        if addr < SYSTEM_AREA_END:
            return "system area"
        if addr < image_end:
            return "image data"
        if addr < stacks_end:
            return "vCPU stacks"
        return "heap"

    def symbol(addr):
        k = bisect.bisect_right(sym_addrs, addr) - 1
        return f"{syms[k][1]}+{addr - syms[k][0]:#x}" if k >= 0 else "?"

    ip, port = a.endpoint.split(":")
    marker = bytes(int(x) for x in ip.split(".")) + int(port).to_bytes(2, "little")
    data = open(a.dump, "rb").read()
    syncs = unions = divergent = 0
    by_region = collections.Counter()
    pages_by_region = collections.Counter()
    per_page = collections.Counter()
    blocks_per_page = collections.Counter()
    image_blocks = collections.Counter()
    received = collections.Counter()
    for union, pages in records(data):
        syncs += 1
        unions += union
        divergent += len(pages)
        for page, mask, blocks in pages:
            addr = page * PAGE
            r = region(addr)
            pages_by_region[r] += 1
            by_region[r] += len(blocks)
            per_page[addr] += 1
            blocks_per_page[addr] += len(blocks)
            for b, mine, leader in blocks:
                if r == "image data":
                    image_blocks[symbol(addr + b * BLOCK)] += 1
                # smoltcp's tcp::Socket: SND.UNA, RCV.NXT, SND.NXT, ... then
                # the tuple (local endpoint first).
                p = mine.find(marker)
                if p >= 16 and mine[p - 2:p + len(marker) + 6] == leader[p - 2:p + len(marker) + 6]:
                    rm = struct.unpack_from("<I", mine, p - 14)[0]
                    rl = struct.unpack_from("<I", leader, p - 14)[0]
                    received[(rm - rl + 2**31) % 2**32 - 2**31] += 1
    if not syncs:
        raise SystemExit("no syncvm in the dump")
    total_blocks = sum(by_region.values())
    print(f"{syncs} syncvms: per syncvm {unions / syncs:.0f} pages compared, {divergent / syncs:.1f} differed, "
          f"{total_blocks / syncs:.0f} blocks of 64 bytes differed")
    print("\nper syncvm, by region: pages, blocks (share of blocks)")
    for r, n in by_region.most_common():
        print(f"  {r:24} {pages_by_region[r] / syncs:6.1f} {n / syncs:7.1f}  ({100 * n / max(total_blocks, 1):.0f}%)")
    if image_blocks:
        print("\nimage data blocks, by nearest symbol (times)")
        for s, n in image_blocks.most_common(10):
            print(f"  {n:7} {s}")
    print(f"\npages that differed most often (address, share of syncvms, mean blocks, region)")
    for addr, n in per_page.most_common(a.top):
        print(f"  {addr:#010x} {100 * n / syncs:5.1f}% {blocks_per_page[addr] / n:5.1f}  {region(addr)}")
    if received:
        print("\nTCP sockets found in differing blocks: secondary's RCV.NXT minus the leader's (bytes: count)")
        print("  " + ", ".join(f"{d:+}: {n}" for d, n in sorted(received.items(), key=lambda x: -x[1])[:10]))


if __name__ == "__main__":
    main()
