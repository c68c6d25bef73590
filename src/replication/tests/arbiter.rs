//! The arbiter against a real etcd (Debian `etcd-server`, installed by
//! scripts/setup.sh): claims are compare-and-swaps, exactly one of two
//! racing sides wins, an unreachable arbiter is an error and never a win.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ftvm_replication::arbiter::{Arbiter, ArbiterError, Claim};

/// A private etcd on free loopback ports, killed on drop.
struct Etcd {
    child: Child,
    endpoint: String,
    dir: std::path::PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Etcd {
    fn start(tag: &str) -> Etcd {
        let dir = std::env::temp_dir().join(format!("ftvm-etcd-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "arbiter", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("arbiter={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd runs (scripts/setup.sh installs etcd-server)");
        let etcd = Etcd { child, endpoint, dir };
        let probe = Arbiter::new(&etcd.endpoint, "probe");
        let deadline = Instant::now() + Duration::from_secs(20);
        while probe.read().is_err() {
            assert!(Instant::now() < deadline, "etcd did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        etcd
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn ownership_moves_only_by_compare_and_swap() {
    let etcd = Etcd::start("cas");
    let arbiter = Arbiter::new(&etcd.endpoint, "vm1");
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
    assert!(matches!(arbiter.claim(&primary, "primary").unwrap(), Claim::Lost(o) if o.owner == "backup"));
    // Other VMs' keys are separate.
    assert_eq!(Arbiter::new(&etcd.endpoint, "vm2").read().unwrap().generation, 0);
}

#[test]
fn of_two_racing_claims_exactly_one_wins() {
    let etcd = Etcd::start("race");
    let arbiter = Arbiter::new(&etcd.endpoint, "vm");
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
