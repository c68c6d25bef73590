#!/usr/bin/env python3
"""Does a Linux receiver that never reads close its TCP window on a sender of
small messages? Host-only reproduction of issue 27 (unit/obuf-limits under
protection): two network namespaces joined by a veth pair, a receiver that
accepts and never reads, and a sender writing MSG-byte messages (TCP_NODELAY,
autocorking off, one segment each) in bursts of BURST every BURST*INTERVAL ms,
for at most SECONDS. It reports when the receiver's window first held 1 KiB of
written data back in the sender (checked every 100 ms: the backpressure
that lets Redis's output buffer for the client grow) and what the
receiver then held.

usage (root): scripts/window-repro.py INTERVAL_MS [BURST] [--seconds S]
              [--rmem-max BYTES] [--shrink 0|1] [--msg BYTES]
"""
import argparse, ctypes, fcntl, os, re, socket, subprocess, sys, time

A, B = "obrepro-snd", "obrepro-rcv"
ADDR_A, ADDR_B, PORT = "10.99.0.1", "10.99.0.2", 6399


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True).stdout


def up(rmem_max, shrink):
    down()
    for ns in (A, B):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", A, "link", "add", "v0", "type", "veth", "peer", "name", "v1", "netns", B)
    sh("ip", "-n", A, "addr", "add", ADDR_A + "/24", "dev", "v0")
    sh("ip", "-n", B, "addr", "add", ADDR_B + "/24", "dev", "v1")
    sh("ip", "-n", A, "link", "set", "v0", "up")
    sh("ip", "-n", B, "link", "set", "v1", "up")
    sh("ip", "netns", "exec", A, "sysctl", "-qw", "net.ipv4.tcp_autocorking=0")
    sh("ip", "netns", "exec", B, "sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {rmem_max}")
    sh("ip", "netns", "exec", B, "sysctl", "-qw", f"net.ipv4.tcp_shrink_window={shrink}")


def setns(path):
    # os.setns needs Python 3.12; libc's does the same.
    fd = os.open(path, os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns " + path)
    os.close(fd)


def unsent(s):
    """Bytes written to `s` that TCP has not sent yet (SIOCOUTQNSD)."""
    return int.from_bytes(fcntl.ioctl(s.fileno(), 0x894B, bytes(4)), "little")


def down():
    for ns in (A, B):
        sh("ip", "netns", "del", ns, check=False)


def receiver_state():
    out = sh("ip", "netns", "exec", B, "ss", "-tmin", "state", "established", f"( sport = {PORT} )")
    q = re.search(r"^(\d+)\s+\d+\s+" + re.escape(ADDR_B), out, re.M)
    sk = re.search(r"skmem:\(r(\d+),rb(\d+)", out)
    ws = re.search(r"wscale:(\d+),(\d+)", out)
    return dict(recvq=int(q[1]) if q else -1, r=int(sk[1]) if sk else -1, rb=int(sk[2]) if sk else -1,
                rcv_wscale=int(ws[2]) if ws else -1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("interval_ms", type=float)
    p.add_argument("burst", type=int, nargs="?", default=1)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rmem-max", type=int, default=33554432)
    p.add_argument("--shrink", type=int, default=0)
    p.add_argument("--msg", type=int, default=35)
    o = p.parse_args()
    up(o.rmem_max, o.shrink)
    try:
        rcv = subprocess.Popen(["ip", "netns", "exec", B, sys.executable, "-c",
            f"import socket,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{ADDR_B}',{PORT}));s.listen(1);print('ready',flush=True);c,_=s.accept();time.sleep(3600)"],
            stdout=subprocess.PIPE, text=True)
        rcv.stdout.readline()
        home = os.open("/proc/self/ns/net", os.O_RDONLY)
        setns(f"/run/netns/{A}")
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect((ADDR_B, PORT))
        s.setblocking(False)
        msg = b"x" * o.msg
        period = o.interval_ms * o.burst / 1000
        start = time.monotonic(); nxt = start; sent = 0; closed_at = None; check = start
        while time.monotonic() - start < o.seconds and closed_at is None:
            for _ in range(o.burst):
                try:
                    sent += s.send(msg)
                except BlockingIOError:
                    pass
            nxt += period
            if time.monotonic() >= check:
                # Data the window keeps in the sender (SIOCOUTQNSD): the
                # backpressure the server's output buffer needs to grow.
                if unsent(s) >= 1024:
                    closed_at = time.monotonic() - start
                check += 0.1
            time.sleep(max(0, nxt - time.monotonic()))
        held = unsent(s)
        st = receiver_state()
        rate = sent / (time.monotonic() - start) / 1000
        print(f"interval={o.interval_ms}ms burst={o.burst} msg={o.msg}B rate={rate:.1f}KB/s rmem_max={o.rmem_max} "
              f"shrink={o.shrink} rcv_wscale={st['rcv_wscale']}: "
              + (f"window closed (1 KiB held back) after {closed_at:.2f}s" if closed_at is not None else f"window NEVER closed in {o.seconds:.0f}s")
              + f", sent {sent}B ({held}B of it not sent), receiver queue {st['recvq']}B, its memory r={st['r']} rb={st['rb']}")
        rcv.kill()
    finally:
        if "home" in locals():
            setns(f"/proc/self/fd/{home}")
        down()


main()
