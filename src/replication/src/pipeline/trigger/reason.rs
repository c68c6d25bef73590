//! Why a checkpoint was taken: the trigger's answer, and what the per-epoch
//! figures count. On its own so that the figures name it without the
//! trigger (which reads the output buffer, which reports to telemetry,
//! which keeps the figures).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Why a checkpoint was taken (`trigger` in the metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// The epoch reached its length (periodic) or its maximum (output).
    #[default]
    Epoch,
    /// The disk journal reached its early mark.
    Journal,
    /// Output was held and the guest went idle.
    Idle,
    /// Output was held for the hold bound while the guest kept running.
    Hold,
    /// The first checkpoint for a new backup (the stop-and-copy).
    Sync,
    /// The last checkpoint of a VM that stops.
    Stop,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reason::Epoch => "epoch",
            Reason::Journal => "journal",
            Reason::Idle => "idle",
            Reason::Hold => "hold",
            Reason::Sync => "sync",
            Reason::Stop => "stop",
        })
    }
}

/// Why a checkpoint was started and how its epoch ran: the trigger's
/// figures of one checkpoint.
#[derive(Clone, Copy, Debug, Default)]
pub struct Started {
    pub reason: Reason,
    /// From the previous checkpoint's resume to this pause.
    pub epoch_len: Duration,
    /// The longest it could have run.
    pub max_epoch: Duration,
    /// How long after the previous resume it could start at the earliest
    /// on output (`pacing`).
    pub spacing: Duration,
    /// From the epoch's first held output to the pause (zero: none held).
    pub output_wait: Duration,
    /// The clients its output went to (up to `output::CLIENTS_COUNTED`).
    pub clients: u32,
}
