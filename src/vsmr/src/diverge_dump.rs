//! A diagnostic of what diverges between the two VM replicas: with
//! `FTVM_DIVERGE_DUMP=FILE` in its environment (and `--no-seccomp`: the
//! applier may not open files otherwise), a secondary appends to FILE, at
//! each `syncvm`, every page the leader sent (whole or patched) with the
//! 64-byte blocks in which its own copy differed, both versions of each.
//! `scripts/diverge-report.py FILE` sums it up by guest address
//! (docs/replicas.md, "What diverges").
//!
//! Records, little-endian: `b"SY"`, the union's page count (u64), the
//! number of pages that follow (u64); then per page `b"PG"`, its number
//! (u64), the mask of differing blocks (u64, bit i: bytes 64i..64i+64) and
//! for each set bit, in order, this replica's 64 bytes then the leader's.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use ftvm_replication::pipeline::encode::hash_compare::BlockPatch;
use ftvm_vmm::memory::{GuestRam, PAGE};
use ftvm_vmm::pages::Bundle;

const ENV: &str = "FTVM_DIVERGE_DUMP";
const BLOCK: usize = 64;

fn path() -> Option<&'static PathBuf> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| std::env::var_os(ENV).map(PathBuf::from)).as_ref()
}

/// The secondary, staged and before its commit: `union` pages compared,
/// the leader's whole pages (`bundle`) and patched ones (`staged`, in
/// `patches`' order) against what `ram` holds now.
pub fn record(ram: &GuestRam, union: usize, bundle: &Bundle<'_>, patches: &[BlockPatch], staged: &[Vec<u8>]) {
    let Some(path) = path() else { return };
    let mut pages = Vec::new();
    let mut count = 0u64;
    let mut mine = vec![0u8; PAGE];
    let mut one = |page: u64, leader: &[u8]| {
        if ram.read_page(page, &mut mine).is_err() {
            return;
        }
        let differs = |b: usize| mine[b * BLOCK..(b + 1) * BLOCK] != leader[b * BLOCK..(b + 1) * BLOCK];
        let mask = (0..PAGE / BLOCK).filter(|&b| differs(b)).fold(0u64, |m, b| m | 1 << b);
        pages.extend_from_slice(b"PG");
        pages.extend_from_slice(&page.to_le_bytes());
        pages.extend_from_slice(&mask.to_le_bytes());
        for b in (0..PAGE / BLOCK).filter(|&b| mask & 1 << b != 0) {
            pages.extend_from_slice(&mine[b * BLOCK..(b + 1) * BLOCK]);
            pages.extend_from_slice(&leader[b * BLOCK..(b + 1) * BLOCK]);
        }
        count += 1;
    };
    for e in bundle.entries() {
        if let Some(data) = e.whole() {
            one(e.page, data);
        }
    }
    for (patch, page) in patches.iter().zip(staged) {
        one(patch.page, page);
    }
    let mut out = Vec::with_capacity(18 + pages.len());
    out.extend_from_slice(b"SY");
    out.extend_from_slice(&(union as u64).to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&pages);
    // One write per syncvm, appended: the file can be read while it grows.
    let written = std::fs::OpenOptions::new().create(true).append(true).open(path).and_then(|mut f| f.write_all(&out));
    if let Err(e) = written {
        // Once: under seccomp every syncvm would fail alike.
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(path = %path.display(), "{ENV}: {e} (with --no-seccomp?)");
        }
    }
}
