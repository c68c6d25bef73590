//! What one checkpoint cost the primary and what applying it cost the
//! backup: recorded per epoch, summed into the Prometheus figures
//! (`telemetry`), written as JSON lines (`metrics`) and shown by `ftvm status`.

use serde::{Deserialize, Serialize};

use crate::pipeline::trigger::reason::Reason;

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    pub epoch: u64,
    /// Time the guest was stopped for the checkpoint.
    pub pause_us: u64,
    pub dirty_pages: u64,
    pub disk_writes: u64,
    /// Bytes of disk data the checkpoint carries.
    pub disk_bytes: u64,
    /// Disk requests in flight at the freeze (`--disk-io async`): saved
    /// with the disk, issued again by the backup if it takes over.
    #[serde(default)]
    pub disk_pending: u64,
    /// Why the checkpoint was taken: `epoch` (its epoch reached the
    /// maximum), `journal` (the disk journal's early mark), `idle` (output
    /// held and the guest idle), `hold` (output held for the hold bound),
    /// `sync` (a new backup's first), `stop` (the last).
    pub trigger: Reason,
    /// How long the epoch ran: from the previous checkpoint's resume to this pause.
    pub epoch_us: u64,
    /// The longest it could have run (`--epoch-ms`, or less when adapted).
    pub max_epoch_us: u64,
    /// From the epoch's first held output to the pause: how long the
    /// trigger kept output waiting before its checkpoint started (0: no
    /// output). A frame's hold is about this plus `ack_us`.
    #[serde(default)]
    pub wait_us: u64,
    /// Clients its output went to (TCP peers sent data, up to 16): those
    /// its acknowledgement releases (`--group-commit` spaces checkpoints
    /// by them).
    #[serde(default)]
    pub clients: u32,
    /// The earliest, after the previous resume, it could start on output
    /// (`--trigger output`'s spacing, [`crate::pipeline::trigger::pacing`]).
    #[serde(default)]
    pub spacing_us: u64,
    /// Stopping the VM (kicking the vCPUs out of the guest, parking them
    /// and the device threads) before `pause_us` started counting.
    #[serde(default)]
    pub stop_us: u64,
    /// Write-fault prediction (`--predict-writes`; without it, only
    /// `first_writes`, equal to the dirty pages): pages left writable
    /// through the epoch,
    #[serde(default)]
    pub predicted: u64,
    /// of those, pages whose content changed (sent),
    #[serde(default)]
    pub predicted_written: u64,
    /// and pages whose content had not (filtered out: not sent);
    #[serde(default)]
    pub fake_dirty: u64,
    /// pages dirtied that were not left writable (each took a tracked
    /// first-write fault, or was written by the VMM).
    #[serde(default)]
    pub first_writes: u64,
    /// `--predict-writes adaptive`: regions of 512 pages whose pages it
    /// keeps writable now (the rest are tracked, and sent ahead by
    /// `--prefetch` where that pays).
    #[serde(default)]
    pub regions_kept: u32,
    /// Regions whose verdict (kept or not) this checkpoint's lesson changed.
    #[serde(default)]
    pub regions_flipped: u32,
    /// Bytes of the epoch on the wire: every byte of the checkpoint's
    /// frame, and of the epoch's prefetch frames (`--prefetch`).
    pub bytes: u64,
    /// Pages the checkpoint carried (the stop-and-copy).
    pub commit_pages: u64,
    /// Pages of the epoch sent ahead of its checkpoint while the guest ran
    /// (`--prefetch`; the checkpoint carries those written again since).
    #[serde(default)]
    pub prefetched_pages: u64,
    /// Of those sends, the ones of pages written again before the freeze
    /// (the checkpoint carried them too; each cost the guest a tracked
    /// first write): what `--prefetch adaptive` watches.
    #[serde(default)]
    pub prefetch_wasted: u64,
    /// `--prefetch adaptive`: how late in the epoch its rounds started (0:
    /// all ran; k: from the round at 1 - 1/2^k of the epoch; 7: the last
    /// alone; 8: none).
    #[serde(default)]
    pub prefetch_start: u32,
    /// Bytes its pages took on the wire (entry headers included).
    pub page_bytes: u64,
    /// Bytes sub-page diffs saved against sending their pages whole: the
    /// pages' bytes before diffing are `page_bytes + diff_bytes_saved`.
    pub diff_bytes_saved: u64,
    /// Its diffs went LZ4-compressed (`--diff lz4`, or `auto` while the
    /// link is busy).
    #[serde(default)]
    pub diffs_compressed: bool,
    /// Bytes of its state: vCPUs, devices, clock, disk writes (and the
    /// fake-ACK proxy's state).
    pub state_bytes: u64,
    /// `--fake-ack`: frame bytes the proxy stored at the freeze (acknowledged
    /// to the guest, not yet by the peer), and its flows.
    #[serde(default)]
    pub fake_ack_bytes: u64,
    #[serde(default)]
    pub fake_ack_flows: u64,
    /// Of those flows, the ones in bulk mode (acknowledged early with
    /// `--fake-ack bulk`, the default).
    #[serde(default)]
    pub fake_ack_bulk_flows: u64,
    /// Of those, the frame bytes the checkpoint carried: all of them with
    /// `--fake-ack-state all`, those stored since the previous checkpoint
    /// with `changed`.
    #[serde(default)]
    pub fake_ack_sent_bytes: u64,
    /// Time spent encoding its pages (after the guest resumed).
    pub encode_ns: u64,
    /// From resuming the guest until the checkpoint was handed to the socket
    /// (or acknowledged, if that came first). Time on the wire is in `ack_us`.
    pub transfer_us: u64,
    /// From resuming the guest until the backup's acknowledgement arrived.
    pub ack_us: u64,
    /// Longest time a frame of this epoch was held before release.
    pub hold_us: u64,
    /// From the acknowledgement's arrival until its last frame was on the
    /// network card (frames go out one write each).
    #[serde(default)]
    pub release_us: u64,
    pub frames_released: u64,
}

/// How many acknowledged checkpoints each trigger started: the last
/// epoch's figures alone show only the newest, which a poll every so often
/// can miss when triggers alternate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartedBy {
    pub epoch: u64,
    pub journal: u64,
    pub idle: u64,
    pub hold: u64,
    pub sync: u64,
    pub stop: u64,
}

impl StartedBy {
    pub fn count(&mut self, reason: Reason) {
        *match reason {
            Reason::Epoch => &mut self.epoch,
            Reason::Journal => &mut self.journal,
            Reason::Idle => &mut self.idle,
            Reason::Hold => &mut self.hold,
            Reason::Sync => &mut self.sync,
            Reason::Stop => &mut self.stop,
        } += 1;
    }

    /// Each trigger that started any, as `reason count`.
    pub fn nonzero(&self) -> Vec<(Reason, u64)> {
        let all = [
            (Reason::Idle, self.idle),
            (Reason::Hold, self.hold),
            (Reason::Epoch, self.epoch),
            (Reason::Journal, self.journal),
            (Reason::Sync, self.sync),
            (Reason::Stop, self.stop),
        ];
        all.into_iter().filter(|&(_, n)| n > 0).collect()
    }
}

/// What the backup records for each checkpoint it applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedEpoch {
    pub epoch: u64,
    /// Guest clock when the primary took the checkpoint.
    pub guest_ns: u64,
    /// Host wall-clock time (CLOCK_REALTIME) when the apply completed,
    /// just before the acknowledgement was sent.
    pub applied_unix_ns: u64,
    pub pages: u64,
    pub apply_us: u64,
}
