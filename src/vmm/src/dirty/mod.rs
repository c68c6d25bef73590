//! Dirty-page tracking of guest memory.
//!
//! One interface ([`DirtyLog`]) with two KVM backends: the dirty bitmap with
//! `MANUAL_DIRTY_LOG_PROTECT2` ([`bitmap::BitmapLog`]) and the per-vCPU dirty
//! ring ([`ring::RingLog`]). Writes the VMM itself makes to guest memory are
//! invisible to both and come from the memory's own bitmap; `Vm::collect_dirty`
//! merges the two.

pub mod bitmap;
mod ioctls;
pub mod ring;

use std::fmt;
use std::str::FromStr;

use kvm_ioctls::VmFd;

#[derive(Debug, thiserror::Error)]
pub enum DirtyError {
    #[error("KVM does not support {0} on this host")]
    Unsupported(&'static str),
    #[error("dirty log ioctl {op} failed: {err}")]
    Ioctl { op: &'static str, err: std::io::Error },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DirtyBackend {
    /// KVM_GET_DIRTY_LOG + KVM_CLEAR_DIRTY_LOG (manual protect).
    #[default]
    Bitmap,
    /// KVM's per-vCPU dirty ring.
    Ring,
}

impl fmt::Display for DirtyBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DirtyBackend::Bitmap => "bitmap",
            DirtyBackend::Ring => "ring",
        })
    }
}

impl FromStr for DirtyBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bitmap" => Ok(DirtyBackend::Bitmap),
            "ring" => Ok(DirtyBackend::Ring),
            _ => Err(format!("unknown dirty backend '{s}' (expected bitmap or ring)")),
        }
    }
}

/// A page bitmap over guest RAM, 64 pages per word, page 0 in bit 0 of word 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirtyBitmap {
    words: Vec<u64>,
}

impl DirtyBitmap {
    pub fn new(pages: u64) -> DirtyBitmap {
        DirtyBitmap { words: vec![0; pages.div_ceil(64) as usize] }
    }

    pub fn set(&mut self, page: u64) {
        if let Some(w) = self.words.get_mut((page / 64) as usize) {
            *w |= 1 << (page % 64);
        }
    }

    pub fn is_set(&self, page: u64) -> bool {
        self.words.get((page / 64) as usize).is_some_and(|w| w & (1 << (page % 64)) != 0)
    }

    pub fn or_words(&mut self, other: &[u64]) {
        for (w, o) in self.words.iter_mut().zip(other) {
            *w |= o;
        }
    }

    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }

    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Indices of set pages, ascending.
    pub fn pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut bits = w;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                Some(i as u64 * 64 + b)
            })
        })
    }
}

/// A source of "pages the guest wrote since the last collection".
pub trait DirtyLog: Send {
    /// Forget everything written so far and write-protect all pages, so the
    /// next `collect` reports only writes from now on. Called after logging
    /// was enabled on the memory slot.
    fn start(&mut self, vm: &VmFd) -> Result<(), DirtyError>;
    /// OR the pages written since the last `start`/`collect` into `out` and
    /// re-arm tracking for them.
    fn collect(&mut self, vm: &VmFd, out: &mut DirtyBitmap) -> Result<(), DirtyError>;
    /// A vCPU exited because its ring is full (ring backend only).
    fn ring_full(&mut self, _vm: &VmFd, _vcpu: usize) -> Result<(), DirtyError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_iterates_set_pages() {
        let mut b = DirtyBitmap::new(200);
        for p in [0, 63, 64, 199] {
            b.set(p);
        }
        b.set(500); // out of range: ignored
        assert_eq!(b.pages().collect::<Vec<_>>(), vec![0, 63, 64, 199]);
        assert_eq!(b.count(), 4);
        assert!(b.is_set(63) && !b.is_set(62));
    }

    #[test]
    fn backend_names_round_trip() {
        for b in [DirtyBackend::Bitmap, DirtyBackend::Ring] {
            assert_eq!(b.to_string().parse::<DirtyBackend>().unwrap(), b);
        }
        assert!("pml".parse::<DirtyBackend>().is_err());
    }
}
