//! Whole pages in one frame, read from the running guest: what brings a
//! new copy of a VM up to date (a backup's pre-copy, a consensus replica's
//! rejoin) before checkpoints carry only what changed.

use ftvm_vmm::memory::GuestRam;
use ftvm_vmm::pages::{BundleWriter, RawEncoder};

use crate::protocol::{self, Kind};

/// One pre-copy message in `frame`: `header`, then a bundle with `state`
/// and the `pages` of `ram` as they are now (whole; zero pages left out
/// when `skip_zero`). `each` sees every page as it was read. Returns the
/// pages in the bundle. Shared by the primary's pre-copy and a consensus
/// replica's rejoin (`ftvm_vsmr`'s rejoin).
#[allow(clippy::too_many_arguments)]
pub fn page_frame(
    frame: &mut Vec<u8>,
    kind: Kind,
    header: &[u8],
    state: &[u8],
    ram: &GuestRam,
    pages: &[u64],
    skip_zero: bool,
    buf: &mut [u8],
    mut each: impl FnMut(u64, &[u8]),
) -> Result<u64, ftvm_vmm::VmError> {
    let mut encoder = RawEncoder;
    protocol::begin_frame(frame, kind);
    frame.extend_from_slice(header);
    let mut bundle = BundleWriter::begin(frame, state, &mut encoder, skip_zero);
    for &p in pages {
        // A torn read is harmless: dirty tracking (or, for a rejoin, the
        // hash of what was read) makes a page written meanwhile go again.
        ram.read_page(p, buf)?;
        each(p, buf);
        bundle.page(p, buf);
    }
    let written = bundle.finish().pages;
    protocol::finish_frame(frame);
    Ok(written)
}
