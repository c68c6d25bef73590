//! The arbiter against a real etcd (Debian `etcd-server`, installed by
//! scripts/setup.sh): claims are compare-and-swaps, exactly one of two
//! racing sides wins, an unreachable arbiter is an error and never a win.

use ftvm_replication::arbiter::{Arbiter, ArbiterError, Claim};
use ftvm_testkit::etcd::Etcd;
use ftvm_testkit::scratch::Scratch;

fn free_port() -> u16 {
    ftvm_testkit::ports::free_port().unwrap()
}

fn etcd(tag: &str) -> (Scratch, Etcd) {
    let dir = Scratch::new(tag).unwrap();
    let etcd = Etcd::start(dir.path()).unwrap();
    (dir, etcd)
}

#[test]
fn ownership_moves_only_by_compare_and_swap() {
    let (_dir, etcd) = etcd("arbiter-cas");
    let arbiter = Arbiter::new(etcd.endpoint(), "vm1");
    let nobody = arbiter.read().unwrap();
    assert_eq!((nobody.generation, nobody.revision), (0, 0));

    let Claim::Won(primary) = arbiter.claim(&nobody, "primary").unwrap() else { panic!("first claim lost") };
    assert_eq!((primary.generation, primary.owner.as_str()), (1, "primary"));
    assert_eq!(arbiter.read().unwrap(), primary);

    // A second claim from the same stale view loses and learns the owner.
    match arbiter.claim(&nobody, "intruder").unwrap() {
        Claim::Lost(current) => assert_eq!(current, primary),
        won => panic!("a stale claim won: {won:?}"),
    }
    let Claim::Won(backup) = arbiter.claim(&primary, "backup").unwrap() else { panic!("claim from the current view lost") };
    assert_eq!(backup.generation, 2);
    // The same claim again (a retry after a timeout that did reach etcd) is still won.
    assert_eq!(arbiter.claim(&primary, "backup").unwrap(), Claim::Won(backup.clone()));
    assert!(matches!(arbiter.claim(&primary, "primary").unwrap(), Claim::Lost(o) if o.owner == "backup"));
    // Other VMs' keys are separate.
    assert_eq!(Arbiter::new(etcd.endpoint(), "vm2").read().unwrap().generation, 0);
}

#[test]
fn of_two_racing_claims_exactly_one_wins() {
    let (_dir, etcd) = etcd("arbiter-race");
    let arbiter = Arbiter::new(etcd.endpoint(), "vm");
    let Claim::Won(seen) = arbiter.claim(&arbiter.read().unwrap(), "start").unwrap() else { panic!() };
    for round in 0..20 {
        let seen = arbiter.read().unwrap();
        let sides: Vec<_> = ["primary", "backup"]
            .into_iter()
            .map(|me| {
                let (arbiter, seen) = (arbiter.clone(), seen.clone());
                std::thread::spawn(move || arbiter.claim(&seen, me).unwrap())
            })
            .collect();
        let wins = sides.into_iter().map(|t| t.join().unwrap()).filter(|c| matches!(c, Claim::Won(_))).count();
        assert_eq!(wins, 1, "round {round}");
    }
    assert_eq!(arbiter.read().unwrap().generation, seen.generation + 20);
}

#[test]
fn an_unreachable_arbiter_is_an_error() {
    let arbiter = Arbiter::new(&format!("http://127.0.0.1:{}", free_port()), "vm");
    assert!(matches!(arbiter.read(), Err(ArbiterError::Unreachable { .. })));
    let seen = ftvm_replication::arbiter::Ownership { generation: 0, owner: String::new(), revision: 0 };
    assert!(matches!(arbiter.claim(&seen, "me"), Err(ArbiterError::Unreachable { .. })));
}
