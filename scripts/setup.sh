#!/usr/bin/env bash
# Everything a fresh machine needs before ftvm can run: checks the host,
# builds the VMM and the guest images. Idempotent; runs from any directory.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

command -v cargo >/dev/null || { echo "setup: cargo not found: install Rust (rustup)" >&2; exit 1; }
[ -e /dev/kvm ] || echo "setup: warning: /dev/kvm is missing; VMs cannot run on this host" >&2

# The network tests drive real clients (redis-cli, ping) against guests in
# network namespaces; redis-server is there for native baselines, and it
# and memcached are Debian's dynamically linked programs that the Linux
# personality runs unmodified (tests/dynamic.rs), libmemcached-tools the
# client tools run against that memcached (memcapable, memaslap); etcd is
# the replication arbiter (tests and the demo start their own instances);
# prometheus (and its promtool) scrapes --metrics-listen in the tests.
# libclang-dev is for the userfaultfd crate's bindings (bindgen).
# musl-tools (musl-gcc) builds the static Linux programs the Linux
# personality runs (scripts/build-images.sh, scripts/build-redis.sh); gcc
# the dynamically linked ones (glibc). tcl runs Redis's own test suite
# (ftvm-bench redis-suite).
apt_packages=(redis-tools redis-server memcached libmemcached-tools gcc libc6-dev tcl iproute2 iputils-ping tcpdump etcd-server etcd-client prometheus musl-tools libclang-dev)
# pip fetches the Redis sources (scripts/build-redis.sh).
python3 -m pip --version >/dev/null 2>&1 || apt_packages+=(python3-pip)
missing=()
for p in "${apt_packages[@]}"; do
    # Not `dpkg -s` alone: it succeeds for removed packages that left config files.
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null || { echo "setup: apt-get not found; install ${missing[*]} by hand" >&2; exit 1; }
    sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    echo "setup: installing ${missing[*]}" >&2
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # The packages start daemons (redis on :6379, memcached on :11211, etcd on :2379, prometheus
    # on :9090) where an init system allows it; tests start their own
    # servers, so stray ones would only confuse them.
    for daemon in redis-server memcached etcd prometheus; do
        if [ -d /run/systemd/system ]; then
            "${sudo[@]}" systemctl disable --now "$daemon" >/dev/null 2>&1 || true
        else
            "${sudo[@]}" service "$daemon" stop >/dev/null 2>&1 || true
            "${sudo[@]}" update-rc.d "$daemon" disable >/dev/null 2>&1 || true
        fi
    done
    "${sudo[@]}" pkill -x redis-server || true
    "${sudo[@]}" pkill -x memcached || true
    "${sudo[@]}" pkill -x etcd || true
    "${sudo[@]}" pkill -x prometheus || true
fi

cargo build --release --workspace --quiet
scripts/build-images.sh
scripts/build-redis.sh
