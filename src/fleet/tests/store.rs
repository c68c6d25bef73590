//! The fleet's store against a real etcd (Debian `etcd-server`, installed
//! by scripts/setup.sh): specs are created once, a host is held by one
//! agent, a dead agent's host and reports expire with its lease, one agent
//! leads, and a placement is written only over the one it was decided from.

use std::time::{Duration, Instant};

use ftvm_fleet::placement::{plan, Change};
use ftvm_fleet::{Host, Report, Role, Store, StoreError, VmSpec};
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::scratch::Scratch;

fn spec(name: &str) -> VmSpec {
    VmSpec::from_toml(&format!("name = \"{name}\"\nimage = \"/kv.elf\"\nmemory_mib = 64\nmac = \"52:54:00:00:00:01\"")).unwrap()
}

fn host(name: &str) -> Host {
    Host { name: name.into(), memory_mib: 1024, vcpus: 4, repl_addr: "127.0.0.1".into() }
}

#[test]
fn specs_hosts_leases_and_conditioned_placements() {
    let dir = Scratch::new("fleet-store").unwrap();
    let etcd = Etcd::start(dir.path()).unwrap();
    let store = Store::new(etcd.endpoint());

    store.create_vm(&spec("a")).unwrap();
    assert!(matches!(store.create_vm(&spec("a")), Err(StoreError::VmExists(n)) if n == "a"));
    assert!(matches!(store.delete_vm("nope"), Err(StoreError::NoVm(_))));

    // Two agents, each under its own lease; a second agent for h1 is refused.
    let (l1, l2) = (store.lease(Duration::from_secs(2)).unwrap(), store.lease(Duration::from_secs(60)).unwrap());
    store.register(&host("h1"), l1).unwrap();
    store.register(&host("h1"), l1).unwrap();
    let l3 = store.lease(Duration::from_secs(60)).unwrap();
    assert!(matches!(store.register(&host("h1"), l3), Err(StoreError::HostTaken(h)) if h == "h1"));
    store.register(&host("h2"), l2).unwrap();
    store.register(&host("h3"), l3).unwrap();
    assert!(matches!(store.drain("h9"), Err(StoreError::NoHost(_))));

    // One leader at a time.
    assert!(store.lead("h2", l2).unwrap());
    assert!(!store.lead("h3", l3).unwrap());
    assert!(store.lead("h2", l2).unwrap());

    let fleet = store.read().unwrap();
    assert_eq!(fleet.hosts.len(), 3);
    assert_eq!(fleet.leader.as_deref(), Some("h2"));
    let (changes, unplaced) = plan(&fleet);
    assert!(unplaced.is_empty());
    assert!(store.place(&changes[0]).unwrap());
    // The same decision again is stale: the placement moved on since.
    assert!(!store.place(&changes[0]).unwrap(), "a placement written over a newer one");
    let placed = store.read().unwrap().placements["a"].0.clone();
    let primary = placed.primary.clone().unwrap();
    store
        .report(
            "a",
            &Report { host: primary.clone(), role: Role::Primary, protected: true, pid: 1, since_ms: 0, voters: Vec::new(), term: 0 },
            if primary == "h1" { l1 } else { l2 },
        )
        .unwrap();
    assert!(store.read().unwrap().reports("a", &primary, Role::Primary, true));

    // h1's agent stops renewing: its host key goes, and with it its reports.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.read().unwrap().hosts.contains_key("h1") {
        store.renew(l2).unwrap();
        store.renew(l3).unwrap();
        assert!(Instant::now() < deadline, "h1's lease never expired");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(matches!(store.renew(l1), Err(StoreError::LeaseExpired)));
    store.register(&host("h1"), store.lease(Duration::from_secs(60)).unwrap()).unwrap();

    // A placement for a VM deleted meanwhile is not written.
    let stale = Change { vm: "a".into(), placement: placed.clone(), seen: store.read().unwrap().placements["a"].1, why: String::new() };
    store.delete_vm("a").unwrap();
    assert!(!store.place(&stale).unwrap());
    let fleet = store.read().unwrap();
    assert!(fleet.vms.is_empty() && fleet.placements.is_empty() && fleet.reports.is_empty());
}
