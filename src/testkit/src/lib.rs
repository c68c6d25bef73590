//! What ftvm's end-to-end tests (`src/ftvm/tests`), its benchmarks
//! (`ftvm-bench`) and `ftvm demo` share, one of each:
//!
//! - [`process::Process`]: a child process killed and reaped on drop, with
//!   its output collected in memory or in files;
//! - [`scratch::Scratch`]: a directory of its own under the system temp
//!   directory, removed on drop; [`tmpfs::Tmpfs`], a small tmpfs mounted on
//!   one (a host disk that fills up);
//! - [`topology::Topology`]: one private network (client, two hosts, a
//!   replication link) built by `scripts/netns.sh`, torn down on drop, and
//!   [`netns`], to enter its namespaces from a thread and cut its links;
//! - [`fault_proxy::FaultProxy`]: the replication link of a topology
//!   through this process, which delays, holds, drops or cuts its frames,
//!   each direction on its own;
//! - [`pcap::Tcpdump`]: a capture inside a namespace, and its frames;
//!   [`frames`], made-up frames put straight onto an interface;
//! - [`etcd::Etcd`]: a private etcd, the replication arbiter (on loopback,
//!   or inside a namespace of a topology);
//! - [`resp`]: a small blocking Redis (RESP2) client, and [`writers`], client
//!   connections that record every write acknowledged to them;
//! - [`ports::free_port`]: a loopback port for a server to listen on that no
//!   outgoing connection can take first.
//!
//! The demo ships in the `ftvm` binary, so this crate stays small: the
//! standard library and `libc`. Needing root (mounts, namespaces) is the
//! caller's business.

pub mod etcd;
pub mod fault_proxy;
pub mod frames;
pub mod netns;
pub mod pcap;
pub mod ports;
pub mod process;
pub mod resp;
pub mod scratch;
mod sock;
pub mod tmpfs;
pub mod topology;
pub mod writers;

use std::io;
use std::path::{Path, PathBuf};

/// The checkout this program runs from: the first directory holding
/// `scripts/netns.sh` among the ancestors of the running executable
/// (`target/release/ftvm`, `target/release/deps/TEST-HASH`) and the
/// checkout this crate was built in.
pub fn repo_root() -> io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let built_in = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    exe.ancestors().skip(1).take(4).map(Path::to_path_buf).chain([built_in]).find(|dir| dir.join("scripts/netns.sh").is_file()).ok_or_else(
        || {
            io::Error::new(
                io::ErrorKind::NotFound,
                "cannot find scripts/netns.sh above this executable (run it from target/ of a checkout)",
            )
        },
    )
}

/// A name made of `tag`'s first `keep` characters that `allowed` accepts,
/// or `fallback` if none is.
fn name_prefix(tag: &str, keep: usize, allowed: impl Fn(char) -> bool, fallback: &str) -> String {
    let prefix: String = tag.chars().filter(|&c| allowed(c)).take(keep).collect();
    if prefix.is_empty() {
        fallback.to_owned()
    } else {
        prefix
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checkout_is_found() {
        assert!(repo_root().unwrap().join("scripts/netns.sh").is_file());
    }

    #[test]
    fn prefixes_keep_only_allowed_characters() {
        let alnum = |c: char| c.is_ascii_alphanumeric();
        assert_eq!(name_prefix("a-b c/d", 4, alnum, "t"), "abcd");
        assert_eq!(name_prefix("--", 4, alnum, "t"), "t");
        assert_eq!(name_prefix("snapshot", 4, alnum, "t"), "snap");
    }
}
