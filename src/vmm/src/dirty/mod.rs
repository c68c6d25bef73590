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

use kvm_ioctls::VmFd;

use crate::memory::PageBitmap;

#[derive(Debug, thiserror::Error)]
pub enum DirtyError {
    #[error("KVM does not support {0} on this host")]
    Unsupported(&'static str),
    #[error("dirty log ioctl {op} failed: {err}")]
    Ioctl { op: &'static str, err: std::io::Error },
}

crate::switch! {
    /// Where dirty pages come from (`--dirty-backend`).
    pub enum DirtyBackend {
        /// KVM_GET_DIRTY_LOG + KVM_CLEAR_DIRTY_LOG (manual protect).
        Bitmap = "bitmap",
        /// KVM's per-vCPU dirty ring.
        Ring = "ring",
    }
}

/// A source of "pages the guest wrote since the last collection".
pub trait DirtyLog: Send {
    /// Forget everything written so far and write-protect all pages, so the
    /// next `collect` reports only writes from now on. Called after logging
    /// was enabled on the memory slot.
    fn start(&mut self, vm: &VmFd) -> Result<(), DirtyError>;
    /// OR the pages written since the last `start`/`rearm` into `out`. They
    /// stay writable (and reported by every later `harvest`) until `rearm`.
    fn harvest(&mut self, vm: &VmFd, out: &mut PageBitmap) -> Result<(), DirtyError>;
    /// Re-arm tracking for the pages harvested since the last `rearm`,
    /// except for the pages in `leave_writable` where the backend can: those
    /// stay writable and are reported again by every later `harvest` until
    /// a `rearm` no longer leaves them. (The bitmap can; the ring re-arms
    /// every page it harvested.)
    fn rearm(&mut self, vm: &VmFd, leave_writable: &PageBitmap) -> Result<(), DirtyError>;
    /// A vCPU exited because its ring is full (ring backend only).
    fn ring_full(&mut self, _vm: &VmFd, _vcpu: usize) -> Result<(), DirtyError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_round_trip() {
        for b in [DirtyBackend::Bitmap, DirtyBackend::Ring] {
            assert_eq!(b.to_string().parse::<DirtyBackend>().unwrap(), b);
        }
        assert!("pml".parse::<DirtyBackend>().is_err());
    }
}
