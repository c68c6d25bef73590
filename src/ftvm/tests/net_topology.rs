//! The network test topology itself (scripts/netns.sh through
//! `ftvm_testkit::topology`): every network test trusts that it is
//! connected, isolated and cleaned up. Needs root, iproute2 and ping
//! (scripts/setup.sh).

use std::time::Duration;

use ftvm_testkit::topology::{netns_exists, Topology, ROLES};

fn sh(topo: &Topology, role: &str, args: &[&str]) -> String {
    let out = topo.command(role, args[0]).args(&args[1..]).output().expect("command runs");
    assert!(out.status.success(), "{args:?} in {}: {}", topo.ns(role), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A host's bridge answering on the LAN stands in for a guest behind its TAP.
fn stand_in(topo: &Topology, host: &str, addr: &str) {
    sh(topo, host, &["ip", "addr", "add", &format!("{addr}/24"), "dev", "br0"]);
}

#[test]
fn topology_is_built_as_documented() {
    let topo = Topology::new("shape").unwrap();
    for role in ROLES {
        assert!(netns_exists(&topo.ns(role)), "{} missing", topo.ns(role));
        let v6 = sh(&topo, role, &["sysctl", "-n", "net.ipv6.conf.all.disable_ipv6"]);
        assert_eq!(v6.trim(), "1", "IPv6 on in {}", topo.ns(role));
    }
    assert!(sh(&topo, "client", &["ip", "-br", "addr", "show", "dev", "eth0"]).contains("10.0.0.1/24"));
    for (host, repl) in [("h1", "192.168.100.1/24"), ("h2", "192.168.100.2/24")] {
        let links = sh(&topo, host, &["ip", "-o", "link", "show", "master", "br0"]);
        assert!(links.contains("tap0") && links.contains("uplink"), "br0 ports in {host}: {links}");
        let tap = sh(&topo, host, &["ip", "tuntap", "show"]);
        assert!(tap.contains("tap0: tap") && tap.contains("vnet_hdr") && tap.contains("persist"), "{tap}");
        assert!(!tap.contains(" pi"), "tap0 must not carry packet info: {tap}");
        assert!(sh(&topo, host, &["ip", "-br", "addr", "show", "dev", "repl"]).contains(repl));
        // The guest is the only LAN presence behind a host.
        assert!(!sh(&topo, host, &["ip", "-br", "addr", "show", "dev", "br0"]).contains("10.0.0."));
    }
    let lan = sh(&topo, "lan", &["ip", "-o", "link", "show", "master", "lan0"]);
    for port in ["client", "h1", "h2"] {
        assert!(lan.contains(&format!(": {port}@")), "lan0 lacks port {port}: {lan}");
    }
}

#[test]
fn client_reaches_both_hosts_and_hosts_reach_each_other() {
    let topo = Topology::new("ping").unwrap();
    assert!(!topo.wait_for_ping("10.0.0.9", Duration::from_millis(500)), "nothing should answer yet");
    stand_in(&topo, "h1", "10.0.0.9");
    stand_in(&topo, "h2", "10.0.0.8");
    assert!(topo.wait_for_ping("10.0.0.9", Duration::from_secs(5)), "h1's bridge unreachable");
    assert!(topo.wait_for_ping("10.0.0.8", Duration::from_secs(5)), "h2's bridge unreachable");
    sh(&topo, "h1", &["ping", "-n", "-q", "-c", "1", "-W", "2", "192.168.100.2"]);
    // Nobody serves redis in this topology: a refused connection is a failure.
    let (ok, _) = topo.redis_cli("10.0.0.9", &["PING"]);
    assert!(!ok);
}

#[test]
fn topologies_are_isolated_and_dropped() {
    let a = Topology::new("iso").unwrap();
    let b = Topology::new("iso").unwrap();
    assert_ne!(a.name(), b.name());
    // The same address in both: each client must see only its own LAN.
    stand_in(&a, "h1", "10.0.0.9");
    assert!(a.wait_for_ping("10.0.0.9", Duration::from_secs(5)));
    assert!(!b.wait_for_ping("10.0.0.9", Duration::from_millis(1500)), "{} sees {}'s LAN", b.name(), a.name());
    stand_in(&b, "h2", "10.0.0.9");
    assert!(b.wait_for_ping("10.0.0.9", Duration::from_secs(5)));

    let (a_ns, b_ns): (Vec<_>, Vec<_>) = (ROLES.map(|r| a.ns(r)).into(), ROLES.map(|r| b.ns(r)).into());
    // A process left inside (like a leaked VMM) must not keep it alive.
    let mut sleeper = a.command("h1", "sleep").arg("600").spawn().expect("sleep runs");
    drop(a);
    assert!(a_ns.iter().all(|ns| !netns_exists(ns)), "{a_ns:?} left behind");
    assert!(b_ns.iter().all(|ns| netns_exists(ns)), "dropping one topology touched another");
    assert!(!sleeper.wait().expect("sleeper reaped").success());
    drop(b);
    assert!(b_ns.iter().all(|ns| !netns_exists(ns)), "{b_ns:?} left behind");
}

#[test]
fn dropped_on_panic() {
    let names = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = names.clone();
    let result = std::thread::spawn(move || {
        let topo = Topology::new("panic").unwrap();
        seen.lock().unwrap().extend(ROLES.map(|r| topo.ns(r)));
        panic!("test failure inside a topology");
    })
    .join();
    assert!(result.is_err());
    let names = names.lock().unwrap();
    assert_eq!(names.len(), ROLES.len());
    assert!(names.iter().all(|ns| !netns_exists(ns)), "{names:?} left behind");
}
