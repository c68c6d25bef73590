//! Counters and histograms of replication for Prometheus (`--metrics-listen`).
//!
//! Like Firecracker's `METRICS`, one set per process ([`telemetry`]): an
//! ftvm process runs one VM, and the places that count (the acknowledgement
//! reader, the backup's apply, the output buffer) need no handle passed down
//! to them. Updating one is an atomic add. The set is encoded by whoever
//! serves it ([`Telemetry::register`]); state that is not counted here
//! (role, protection, epoch) is read from the side's `StatusCell` (in
//! `metrics`, which stands on this module) at scrape time.

use std::sync::LazyLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::figures::{AppliedEpoch, EpochMetrics};

pub struct Telemetry {
    checkpoints: Counter,
    started_by: Family<Started, Counter>,
    pause: Histogram,
    transfer: Histogram,
    ack: Histogram,
    dirty_pages: Counter,
    last_dirty_pages: Gauge,
    bytes: Counter,
    disk_writes: Counter,
    disk_bytes: Counter,
    frames_released: Counter,
    hold: Histogram,
    wait: Histogram,
    stop: Histogram,
    release: Histogram,
    held_frames: Gauge,
    backup_losses: Counter,
    applied: Counter,
    applied_pages: Counter,
    apply: Histogram,
    takeovers: Counter,
    metrics_write_errors: Counter,
}

/// What started a checkpoint (`trigger` in the JSON-lines metrics).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Started {
    trigger: String,
}

/// From 50 us to about 50 s: a pause is tens of microseconds to tens of
/// milliseconds, an acknowledgement up to the acknowledgement timeout.
fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(50e-6, 2.0, 21))
}

fn us(us: u64) -> f64 {
    us as f64 / 1e6
}

static TELEMETRY: LazyLock<Telemetry> = LazyLock::new(|| Telemetry {
    checkpoints: Counter::default(),
    started_by: Family::default(),
    pause: seconds(),
    transfer: seconds(),
    ack: seconds(),
    dirty_pages: Counter::default(),
    last_dirty_pages: Gauge::default(),
    bytes: Counter::default(),
    disk_writes: Counter::default(),
    disk_bytes: Counter::default(),
    frames_released: Counter::default(),
    hold: seconds(),
    wait: seconds(),
    stop: seconds(),
    release: seconds(),
    held_frames: Gauge::default(),
    backup_losses: Counter::default(),
    applied: Counter::default(),
    applied_pages: Counter::default(),
    apply: seconds(),
    takeovers: Counter::default(),
    metrics_write_errors: Counter::default(),
});

/// This process's replication figures.
pub fn telemetry() -> &'static Telemetry {
    &TELEMETRY
}

impl Telemetry {
    /// The primary's checkpoint `m` was acknowledged (its figures are complete).
    pub fn acknowledged(&self, m: &EpochMetrics) {
        self.checkpoints.inc();
        self.started_by.get_or_create(&Started { trigger: m.trigger.to_string() }).inc();
        self.pause.observe(us(m.pause_us));
        self.transfer.observe(us(m.transfer_us));
        self.ack.observe(us(m.ack_us));
        self.stop.observe(us(m.stop_us));
        self.dirty_pages.inc_by(m.dirty_pages);
        self.last_dirty_pages.set(m.dirty_pages as i64);
        self.bytes.inc_by(m.bytes);
        self.disk_writes.inc_by(m.disk_writes);
        self.disk_bytes.inc_by(m.disk_bytes);
        self.frames_released.inc_by(m.frames_released);
        if m.frames_released > 0 {
            self.hold.observe(us(m.hold_us));
            self.release.observe(us(m.release_us));
        }
        if m.wait_us > 0 {
            self.wait.observe(us(m.wait_us));
        }
    }

    /// The output buffer now holds `delta` more (or fewer) frames.
    pub fn held(&self, delta: i64) {
        self.held_frames.inc_by(delta);
    }

    /// The primary lost its backup.
    pub fn backup_lost(&self) {
        self.backup_losses.inc();
    }

    /// The backup applied a checkpoint.
    pub fn applied(&self, a: &AppliedEpoch) {
        self.applied.inc();
        self.applied_pages.inc_by(a.pages);
        self.apply.observe(us(a.apply_us));
    }

    /// The backup took the VM over from a lost primary.
    pub fn took_over(&self) {
        self.takeovers.inc();
    }

    /// A line of a `--metrics` file could not be written (and was dropped).
    pub fn metrics_write_failed(&self) {
        self.metrics_write_errors.inc();
    }

    /// Lines of `--metrics` files dropped so far.
    pub fn metrics_write_errors(&self) -> u64 {
        self.metrics_write_errors.get()
    }

    /// Add every figure to `registry` (prefix it `ftvm`).
    pub fn register(&'static self, registry: &mut Registry) {
        use Figure::*;
        let figures = [
            ("checkpoints", "Checkpoints the backup acknowledged (primary)", Count(&self.checkpoints)),
            (
                "checkpoints_started",
                "Acknowledged checkpoints by what started them (idle, hold, epoch, journal, sync, stop)",
                Triggers(&self.started_by),
            ),
            ("checkpoint_pause", "Time the guest was paused per checkpoint", Seconds(&self.pause)),
            ("checkpoint_transfer", "From resuming the guest until the checkpoint was handed to the transport", Seconds(&self.transfer)),
            ("checkpoint_ack", "From resuming the guest until the backup acknowledged the checkpoint", Seconds(&self.ack)),
            ("dirty_pages", "Dirty pages carried by acknowledged checkpoints", Count(&self.dirty_pages)),
            ("checkpoint_dirty_pages", "Dirty pages of the last acknowledged checkpoint", Level(&self.last_dirty_pages)),
            ("checkpoint", "Checkpoint bytes on the wire", Bytes(&self.bytes)),
            ("disk_writes", "Guest disk writes carried by checkpoints", Count(&self.disk_writes)),
            ("checkpoint_disk", "Disk data carried by checkpoints", Bytes(&self.disk_bytes)),
            ("output_frames_released", "Network frames released after their epoch was acknowledged", Count(&self.frames_released)),
            ("output_hold", "Longest time a frame of an epoch was held before release", Seconds(&self.hold)),
            ("output_wait", "From an epoch's first held output until its checkpoint paused the guest", Seconds(&self.wait)),
            ("output_release", "From an acknowledgement until its epoch's last frame was written out", Seconds(&self.release)),
            ("checkpoint_stop", "Stopping the vCPUs and device threads before a checkpoint's pause", Seconds(&self.stop)),
            ("output_held_frames", "Network frames held now, waiting for an acknowledgement", Level(&self.held_frames)),
            ("backup_losses", "Times the primary lost its backup", Count(&self.backup_losses)),
            ("checkpoints_applied", "Checkpoints the backup applied", Count(&self.applied)),
            ("applied_pages", "Pages the backup applied", Count(&self.applied_pages)),
            ("checkpoint_apply", "Time the backup took to apply a checkpoint", Seconds(&self.apply)),
            ("takeovers", "Failovers: times this backup took the VM over from a lost primary", Count(&self.takeovers)),
            (
                "metrics_write_errors",
                "Lines of the --metrics file that could not be written (a full disk, say) and were dropped",
                Count(&self.metrics_write_errors),
            ),
        ];
        for (name, help, figure) in figures {
            match figure {
                Count(c) => registry.register(name, help, c.clone()),
                Bytes(c) => registry.register_with_unit(name, help, Unit::Bytes, c.clone()),
                Level(g) => registry.register(name, help, g.clone()),
                Seconds(h) => registry.register_with_unit(name, help, Unit::Seconds, h.clone()),
                Triggers(f) => registry.register(name, help, f.clone()),
            }
        }
    }
}

/// A figure as [`Telemetry::register`] lists it: its kind, and with it its unit.
enum Figure<'a> {
    Count(&'a Counter),
    Bytes(&'a Counter),
    Level(&'a Gauge),
    Seconds(&'a Histogram),
    Triggers(&'a Family<Started, Counter>),
}
