//! The global allocator: one linked-list heap over the largest FREE region.
//! (The heap cannot span holes, and the VMM is expected to hand out guest RAM
//! as one large FREE region anyway.)

use alloc::vec::Vec;

use ftvm_abi::{mem_kind, MemRegion};
use linked_list_allocator::LockedHeap;

#[global_allocator]
static HEAP: LockedHeap = LockedHeap::empty();

/// Returns the region the heap covers (size 0 if there is no FREE memory,
/// in which case every allocation fails).
pub(crate) fn init(memmap: &[MemRegion]) -> MemRegion {
    let Some(region) = memmap.iter().filter(|r| r.kind == mem_kind::FREE).max_by_key(|r| r.size).copied() else {
        return MemRegion::default();
    };
    // SAFETY: the VMM gives FREE regions to the guest exclusively; nothing
    // else (image, stacks, boot info) lives there, and init runs once, on
    // vCPU 0, before any allocation.
    unsafe { HEAP.lock().init(region.base as *mut u8, region.size as usize) };
    region
}

/// Bytes of the heap not allocated now (not necessarily in one piece).
pub fn free_bytes() -> usize {
    HEAP.lock().free()
}

/// `len` zero bytes, or None when the heap has no room for them: for
/// buffers a full guest can do without for a while, where `vec!` would end
/// it.
pub fn try_zeroed(len: usize) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.resize(len, 0);
    Some(v)
}
