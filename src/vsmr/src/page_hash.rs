//! XXH3-128 of the live guest pages, as a `syncvm` and a rejoin compare
//! them. Its own module, below `sync`, `rejoin` and `aside`: the copy set
//! aside is checked against these hashes, and `sync` uses the copy.

use std::convert::Infallible;

use xxhash_rust::xxh3::xxh3_128;

use ftvm_vmm::memory::{GuestRam, PAGE};

use crate::cores::on_cores;

/// XXH3-128 of each page, on every core.
pub(crate) fn hash_pages(ram: &GuestRam, pages: &[u64]) -> Vec<u128> {
    let mut out = vec![0u128; pages.len()];
    let Ok(()) = on_cores(pages, &mut out, 1, |p, o| {
        hash_into(ram, p, o);
        Ok::<(), Infallible>(())
    });
    out
}

fn hash_into(ram: &GuestRam, pages: &[u64], out: &mut [u128]) {
    let mut buf = vec![0u8; PAGE];
    for (&p, o) in pages.iter().zip(out) {
        // Pages come from a bitmap of this RAM's size: always in range.
        *o = match ram.read_page(p, &mut buf) {
            Ok(()) => xxh3_128(&buf),
            Err(_) => 0,
        };
    }
}
