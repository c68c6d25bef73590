//! What replication holds at most, in one place: the disk writes one epoch
//! journals, the output held for acknowledgement, and from them the largest
//! checkpoint a primary sends, which is also the backup's frame limit (both
//! sides compute it from the VM's shape in the handshake, with
//! [`checkpoint_limit`]).

use ftvm_vmm::devices::virtio::block::MAX_REQUEST;
use ftvm_vmm::memory::PAGE;

/// What one journaled disk write costs besides its data: its offset and its
/// length as postcard encodes them (two varints of at most 10 bytes each).
/// Counting it bounds the journal also for writes of no data.
pub const WRITE_OVERHEAD: u64 = 20;

/// Journaled bytes (data plus `WRITE_OVERHEAD` per write) at which the
/// primary takes the epoch's checkpoint early.
pub const JOURNAL_EARLY: u64 = JOURNAL_BOUND / 2;

/// Journaled bytes at which the guest's disk stops serving requests until
/// the epoch's checkpoint has taken the journal.
pub const JOURNAL_BOUND: u64 = 64 << 20;

/// The most one epoch's journal holds: requests are admitted while it is
/// below `JOURNAL_BOUND`, and one request writes at most `MAX_REQUEST`.
pub const JOURNAL_MAX: u64 = JOURNAL_BOUND + MAX_REQUEST as u64 + WRITE_OVERHEAD;

/// What one held frame costs besides its bytes (its queue entry).
pub const FRAME_OVERHEAD: u64 = 64;

/// Held output (frame bytes plus `FRAME_OVERHEAD` each) at which the guest's
/// transmit queue stops being served until output is released.
pub const HELD_OUTPUT_BOUND: u64 = 16 << 20;

/// Bytes of an epoch's first frames its checkpoint carries for the
/// backup to replay at a takeover (`--mirror on`); the frames after them
/// travel as mirrored datagrams. A reply or two of a request-response
/// service fit; a bulk transfer's data does not ride on (and delay) the
/// checkpoint.
pub const OUTPUT_FOLD_MAX: u64 = 64 << 10;

/// What the folded frames add to a checkpoint at most: their bytes and,
/// per frame, postcard's length prefix (at most 10 bytes; a frame is at
/// least one byte).
pub const OUTPUT_FOLD_STATE_MAX: u64 = OUTPUT_FOLD_MAX * 11 + 10;

/// Frame bytes the fake-ACK proxy stores at most (data acknowledged to the
/// guest that the peer has not acknowledged yet, `--fake-ack`): checkpoints
/// carry all of it, so it is kept small; beyond it the guest's segments go
/// unacknowledged until the peer's ACKs make room.
pub const FAKE_ACK_BOUND: u64 = 1 << 20;

/// What the fake-ACK state adds to a checkpoint at most: the stored frames
/// and, per flow, its fields and each stored segment's header (generous).
pub const FAKE_ACK_STATE_MAX: u64 = FAKE_ACK_BOUND * 2 + (crate::fakeack::flow::MAX_FLOWS as u64) * 128;

/// The most pages the primary keeps the last sent version of for diffs
/// (`--diff`), for a guest of `ram_pages` pages: a quarter of its RAM, at
/// most 1 GiB. The pages a guest dirties within a few epochs are far fewer
/// (thousands at most at 20 ms, see `docs/replication.md`); what does not
/// fit is sent whole.
pub fn last_sent_pages(ram_pages: u64) -> usize {
    const MAX: u64 = (1 << 30) / PAGE as u64;
    (ram_pages / 4).clamp(1, MAX) as usize
}

/// The most a VM of `vcpus` vCPUs needs for its saved state (vCPU registers,
/// XSAVE area and MSRs, devices, clock): generous, a few KiB per vCPU are used.
pub fn vm_state_limit(vcpus: u32) -> u64 {
    (256 << 10) + u64::from(vcpus) * (64 << 10)
}

/// The largest checkpoint payload a primary whose VM has `mem_size` bytes
/// and `vcpus` vCPUs sends: its epoch, then a bundle whose state is the VM
/// state plus at most `JOURNAL_MAX` of disk writes (with postcard's length
/// prefix) and whose pages are every page of RAM at most once. The primary
/// refuses to send more; the backup refuses to read more.
pub fn checkpoint_limit(mem_size: u64, vcpus: u32) -> u64 {
    let state = vm_state_limit(vcpus) + 10 + JOURNAL_MAX + FAKE_ACK_STATE_MAX + OUTPUT_FOLD_STATE_MAX;
    8 + ftvm_vmm::pages::max_bundle_len(state, mem_size / PAGE as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_may_hold_all_of_ram_and_a_full_journal() {
        let mem = 256u64 << 20;
        let limit = checkpoint_limit(mem, 2);
        assert!(limit > mem + JOURNAL_MAX, "{limit}");
        // ... and not much more: the backup's buffer is sized by it.
        assert!(limit < mem + mem / 256 + JOURNAL_MAX + FAKE_ACK_STATE_MAX + OUTPUT_FOLD_STATE_MAX + (1 << 20), "{limit}");
        assert!(checkpoint_limit(mem, 32) > limit, "more vCPUs, more state");
        const { assert!(JOURNAL_EARLY < JOURNAL_BOUND && JOURNAL_BOUND < JOURNAL_MAX) };
    }
}
