//! Fault injection for tests: `FTVM_TEST_FAULT=truncate:N` or `flip:N` makes
//! a primary send checkpoint N cut in half or with one bit flipped, then die
//! on the spot like a crashed host; `stall-apply:N` makes a backup hang
//! before it applies checkpoint N, while the rest of it (its heartbeats)
//! runs on; `die-after-prefetch:N` makes a primary with `--prefetch on`
//! die like a crashed host right after it sent its first prefetch round of
//! an epoch N or later (the backup has it staged, not committed);
//! `xsave-size:N` makes a backup describe its host as having an XSAVE area
//! of N bytes (so it refuses a primary whose vCPUs need more);
//! `syncvm-digest:1` makes consensus-ordered replicas record a digest of
//! the whole guest memory at each `syncvm` (the leader's at its freeze, the
//! secondary's once the pages are applied), so a test can compare them;
//! `syncvm-digest-slow-ack:MS` does too, and makes a secondary hold each
//! `syncvm`'s acknowledgement MS ms (its guest paused), so that the leader
//! proposes the next one before it (`--sync-pipeline on`);
//! `syncvm-slow-ack:MS` only holds the acknowledgements;
//! `syncvm-digest-collide:N` records the digests too, and makes a leader
//! leave one differing block out of every N-th block patch it sends, as a
//! collision of that block's 16-bit hashes would (the secondary's page
//! check must catch it and have the page sent whole);
//! `syncvm-digest-short:N` records the digests too, and makes a leader
//! take every N-th divergent page of an ordinary `syncvm` for unchanged, as
//! a collision of its 32-bit page hashes would (the secondary's union
//! digest must catch it and refuse the `syncvm`, and a full one follow).
//! (`forbidden-syscall:KIND` is `ftvm_vmm::seccomp`'s; `slow-disk:MS`, every
//! disk write MS ms longer, is `ftvm_vmm::devices::virtio::block`'s.) Never
//! set outside tests.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use ftvm_vmm::arch::compat::CpuProfile;

use crate::pipeline::transport::Transport;

pub const ENV: &str = "FTVM_TEST_FAULT";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Truncate,
    Flip,
    /// The backup's apply hangs (handled by the backup, not `inject`).
    StallApply,
    /// The backup reports another XSAVE area size (`host_profile`).
    XsaveSize,
    /// The primary dies after a prefetch round (`dies_after_prefetch`).
    DieAfterPrefetch,
    /// Replicas digest guest memory at each `syncvm` (`syncvm_digest`).
    SyncvmDigest,
    /// The same, and secondaries acknowledge late (`syncvm_slow_ack`).
    SyncvmDigestSlowAck,
    /// Secondaries acknowledge late, without the digests.
    SyncvmSlowAck,
    /// Digests, and leaders' block patches with a block left out
    /// (`syncvm_collision`).
    SyncvmDigestCollide,
    /// Digests, and leaders' divergent pages taken for unchanged
    /// (`syncvm_short_collision`).
    SyncvmDigestShort,
}

fn configured() -> Option<(Fault, u64)> {
    static FAULT: OnceLock<Option<(Fault, u64)>> = OnceLock::new();
    *FAULT.get_or_init(|| {
        let spec = std::env::var(ENV).ok()?;
        let (kind, epoch) = spec.split_once(':')?;
        let fault = match kind {
            "truncate" => Fault::Truncate,
            "flip" => Fault::Flip,
            "stall-apply" => Fault::StallApply,
            "xsave-size" => Fault::XsaveSize,
            "die-after-prefetch" => Fault::DieAfterPrefetch,
            "syncvm-digest" => Fault::SyncvmDigest,
            "syncvm-digest-slow-ack" => Fault::SyncvmDigestSlowAck,
            "syncvm-slow-ack" => Fault::SyncvmSlowAck,
            "syncvm-digest-collide" => Fault::SyncvmDigestCollide,
            "syncvm-digest-short" => Fault::SyncvmDigestShort,
            _ => return None,
        };
        Some((fault, epoch.parse().ok()?))
    })
}

/// The fault a primary injects when it sends checkpoint `epoch`.
pub fn for_epoch(epoch: u64) -> Option<Fault> {
    configured().filter(|&(f, e)| e == epoch && matches!(f, Fault::Truncate | Fault::Flip)).map(|(f, _)| f)
}

/// Whether a primary that just sent a prefetch round of `epoch` dies now.
pub fn dies_after_prefetch(epoch: u64) -> bool {
    matches!(configured(), Some((Fault::DieAfterPrefetch, from)) if epoch >= from)
}

/// On a backup about to apply checkpoint `epoch`: hang forever if told to.
pub fn stall_apply(epoch: u64) {
    if configured() == Some((Fault::StallApply, epoch)) {
        tracing::warn!(epoch, "test fault injected; this backup's apply hangs");
        loop {
            std::thread::park();
        }
    }
}

/// This host's vCPU profile as a backup reports it: as it is, or with the
/// XSAVE area size it was told to claim.
pub fn host_profile(mut profile: CpuProfile) -> CpuProfile {
    if let Some((Fault::XsaveSize, size)) = configured() {
        tracing::warn!(size, "test fault injected; this backup reports another XSAVE area size");
        profile.xsave_size = size as u32;
    }
    profile
}

/// Whether replicas digest guest memory at each `syncvm`.
pub fn syncvm_digest() -> bool {
    matches!(
        configured(),
        Some((Fault::SyncvmDigest | Fault::SyncvmDigestSlowAck | Fault::SyncvmDigestCollide | Fault::SyncvmDigestShort, _))
    )
}

/// Whether the divergent page a leader is about to send is taken for
/// unchanged, as if its short hashes had collided: every N-th under
/// `syncvm-digest-short:N`.
pub fn syncvm_short_collision() -> bool {
    static PAGES: AtomicU64 = AtomicU64::new(0);
    match configured() {
        Some((Fault::SyncvmDigestShort, every)) if every > 0 => PAGES.fetch_add(1, Ordering::Relaxed) % every == every - 1,
        _ => false,
    }
}

/// Whether the block patch a leader is about to send loses a block, as if
/// its hashes had collided: every N-th patch under `syncvm-digest-collide:N`.
pub fn syncvm_collision() -> bool {
    static PATCHES: AtomicU64 = AtomicU64::new(0);
    match configured() {
        Some((Fault::SyncvmDigestCollide, every)) if every > 0 => PATCHES.fetch_add(1, Ordering::Relaxed) % every == every - 1,
        _ => false,
    }
}

/// How long a secondary holds each `syncvm`'s acknowledgement.
pub fn syncvm_slow_ack() -> Option<std::time::Duration> {
    match configured() {
        Some((Fault::SyncvmDigestSlowAck | Fault::SyncvmSlowAck, ms)) => Some(std::time::Duration::from_millis(ms)),
        _ => None,
    }
}

impl Fault {
    /// Send `frame` damaged, then end the process without any cleanup.
    pub fn inject(self, link: &mut dyn Transport, frame: &[u8]) -> io::Result<()> {
        tracing::warn!(fault = ?self, "test fault injected; the primary dies now");
        match self {
            Fault::StallApply
            | Fault::XsaveSize
            | Fault::DieAfterPrefetch
            | Fault::SyncvmDigest
            | Fault::SyncvmDigestSlowAck
            | Fault::SyncvmSlowAck
            | Fault::SyncvmDigestCollide
            | Fault::SyncvmDigestShort => return Err(io::Error::other("not a primary's fault")),
            Fault::Truncate => link.send(&frame[..frame.len() / 2])?,
            Fault::Flip => {
                let mut bad = frame.to_vec();
                let mid = bad.len() / 2;
                bad[mid] ^= 0x08;
                link.send(&bad)?;
            }
        }
        // SAFETY: _exit ends the process immediately, as a crash would.
        unsafe { libc::_exit(137) }
    }
}
