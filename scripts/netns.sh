#!/usr/bin/env bash
# One isolated test network per NAME, built from network namespaces, so that
# several tests can each have their own "LAN with two hosts" at once.
#
#   scripts/netns.sh up NAME            build the topology (idempotent)
#   scripts/netns.sh up-fleet NAME N    build a fleet's: N hosts (idempotent)
#   scripts/netns.sh down NAME          tear it down (idempotent)
#   scripts/netns.sh exec NAME ROLE CMD...   run CMD in netns NAME-ROLE
#
# Topology (ROLE = lan, client, h1, h2):
#
#   NAME-client: eth0 10.0.0.1/24 ──┐
#                                   │ veth
#   NAME-lan:    bridge lan0  ◄─────┴── ports "client", "h1", "h2"
#                                   │ veth                 │ veth
#   NAME-h1:     uplink ─ br0 ─ tap0 (VMM)     NAME-h2:  uplink ─ br0 ─ tap0
#                repl 192.168.100.1/24  ◄── veth ──►  repl 192.168.100.2/24
#
# A fleet's topology (`up-fleet NAME N`, N from 2 to 9) has hosts h1..hN
# on the LAN as above, but no tap0 (each VM's agent makes the VM's own TAP on
# br0), and the replication network is a bridge, repl0 in NAME-lan, with
# every host's repl (192.168.100.I/24 for host hI) and the lan namespace
# itself on it (192.168.100.254: where the fleet's etcd serves).
#
# The guest (10.0.0.2/24, 52:54:00:12:34:56 by convention) is the only L2
# presence behind br0, whichever host runs it; the hosts have no address on
# the LAN, only on the replication link. IPv6 is off everywhere to keep
# captures free of router/neighbour solicitations.
set -euo pipefail

roles=(lan client h1 h2)

usage() {
    echo "usage: $0 up NAME | up-fleet NAME N | down NAME | exec NAME ROLE CMD..." >&2
    exit 2
}

check_name() {
    # NAME prefixes netns names only (interfaces keep fixed names inside
    # them), so the limit is about readability and the /run/netns path.
    [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_]{0,15}$ ]] || { echo "netns.sh: bad NAME '$1' (1-16 of [A-Za-z0-9_])" >&2; exit 2; }
}

ns_exists() { [ -e "/run/netns/$1" ]; }
has_link() { ip -n "$1" link show dev "$2" >/dev/null 2>&1; }

ensure_ns() {
    local ns=$1
    ns_exists "$ns" || ip netns add "$ns"
    # "default" covers interfaces created or moved in later; "all" the rest.
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.default.disable_ipv6=1 net.ipv6.conf.all.disable_ipv6=1
    ip -n "$ns" link set lo up
}

ensure_bridge() {
    local ns=$1 br=$2
    has_link "$ns" "$br" || ip -n "$ns" link add "$br" type bridge
    # No STP and no forward delay: ports forward as soon as they are up,
    # so a VMM attaching its TAP does not lose its first frames.
    ip -n "$ns" link set "$br" type bridge stp_state 0 forward_delay 0
    ip -n "$ns" link set "$br" up
}

# A veth pair created with each end directly in its namespace: nothing ever
# appears in the caller's namespace, so fixed names like eth0 or uplink
# cannot clash between topologies and no temporary names are needed.
ensure_veth() {
    local ns_a=$1 if_a=$2 ns_b=$3 if_b=$4
    if has_link "$ns_a" "$if_a" && has_link "$ns_b" "$if_b"; then
        return
    fi
    # A half-present pair cannot be repaired; deleting one end removes both.
    ip -n "$ns_a" link del "$if_a" 2>/dev/null || true
    ip -n "$ns_b" link del "$if_b" 2>/dev/null || true
    ip -n "$ns_a" link add "$if_a" type veth peer name "$if_b" netns "$ns_b"
}

enslave() {
    local ns=$1 dev=$2 br=$3
    ip -n "$ns" link set "$dev" master "$br"
    ip -n "$ns" link set "$dev" up
}

ensure_addr() {
    local ns=$1 dev=$2 addr=$3
    ip -n "$ns" addr replace "$addr" dev "$dev"
    ip -n "$ns" link set "$dev" up
}

up() {
    local name=$1 lan=$1-lan client=$1-client
    for role in "${roles[@]}"; do ensure_ns "$name-$role"; done

    ensure_bridge "$lan" lan0

    ensure_veth "$client" eth0 "$lan" client
    ensure_addr "$client" eth0 10.0.0.1/24
    enslave "$lan" client lan0

    for h in h1 h2; do
        local host=$name-$h
        ensure_bridge "$host" br0
        ensure_veth "$host" uplink "$lan" "$h"
        enslave "$host" uplink br0
        enslave "$lan" "$h" lan0
        # vnet_hdr states the intent (the VMM opens it with
        # IFF_TAP|IFF_NO_PI|IFF_VNET_HDR); the kernel lets the opener set
        # NO_PI and VNET_HDR anyway, only multi_queue has to match.
        if ! has_link "$host" tap0; then
            ip -n "$host" tuntap add dev tap0 mode tap vnet_hdr
        fi
        enslave "$host" tap0 br0
    done

    ensure_veth "$name-h1" repl "$name-h2" repl
    ensure_addr "$name-h1" repl 192.168.100.1/24
    ensure_addr "$name-h2" repl 192.168.100.2/24
    wait_forwarding "$lan" client h1 h2
}

up_fleet() {
    local name=$1 n=$2 lan=$1-lan client=$1-client ports=(client) i host
    [[ "$n" =~ ^[2-9]$ ]] || { echo "netns.sh: bad host count '$n' (2 to 9)" >&2; exit 2; }
    ensure_ns "$lan"
    ensure_ns "$client"
    ensure_bridge "$lan" lan0
    ensure_bridge "$lan" repl0
    # A bridge takes the lowest MAC of its ports unless given one: a host
    # dying (its port deleted) would change the address etcd is reached at
    # while the other hosts' ARP caches still hold the old one (~30 s).
    ip -n "$lan" link set repl0 address 02:00:00:00:01:fe
    ensure_addr "$lan" repl0 192.168.100.254/24
    ensure_veth "$client" eth0 "$lan" client
    ensure_addr "$client" eth0 10.0.0.1/24
    enslave "$lan" client lan0
    for i in $(seq 1 "$n"); do
        host=$name-h$i
        ensure_ns "$host"
        ensure_bridge "$host" br0
        ensure_veth "$host" uplink "$lan" "h$i"
        enslave "$host" uplink br0
        enslave "$lan" "h$i" lan0
        ensure_veth "$host" repl "$lan" "r$i"
        enslave "$lan" "r$i" repl0
        ensure_addr "$host" repl "192.168.100.$i/24"
        ports+=("h$i" "r$i")
    done
    wait_forwarding "$lan" "${ports[@]}"
}

# Recreated ports come up a moment after their link; frames sent before they
# forward are dropped (a lost first ARP costs a client a 1 s retry).
wait_forwarding() {
    local ns=$1
    shift
    for _ in $(seq 100); do
        local all=1
        for port in "$@"; do
            ip -n "$ns" -d link show dev "$port" 2>/dev/null | grep -q "state forwarding" || all=0
        done
        [ "$all" = 1 ] && return 0
        sleep 0.02
    done
}

down() {
    local name=$1 ns pids path
    # Every namespace of the topology, whichever shape it has.
    for path in /run/netns/"$name"-*; do
        [ -e "$path" ] || continue
        ns=${path##*/}
        # A process left inside (a VMM or server of a test that panicked)
        # would keep the namespace and its TAP alive after `ip netns del`.
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns"
    done
}

[ $# -ge 2 ] || usage
cmd=$1 name=$2
check_name "$name"
case "$cmd" in
    up) up "$name" ;;
    up-fleet)
        [ $# -eq 3 ] || usage
        up_fleet "$name" "$3"
        ;;
    down) down "$name" ;;
    exec)
        [ $# -ge 4 ] || usage
        role=$3
        shift 3
        exec ip netns exec "$name-$role" "$@"
        ;;
    *) usage ;;
esac
