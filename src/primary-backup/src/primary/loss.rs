//! Why a primary lost its backup: what the session that replicates to it
//! reports, and what the primary acts on (`--on-backup-loss`).

use ftvm_replication::error::ReplicationError;
use ftvm_replication::protocol::{Kind, ProtocolError};

/// Why the primary lost its backup.
#[derive(Debug, thiserror::Error)]
pub enum BackupLoss {
    // What the backup sent (or how its stream broke).
    #[error("{0}")]
    Stream(ProtocolError),
    #[error("unexpected {0:?} from the backup")]
    Unexpected(Kind),
    #[error("malformed acknowledgement")]
    MalformedAck,
    #[error("{0}")]
    Refused(String),
    // What the backup did not send in time.
    #[error("nothing heard from the backup for {silence_ms} ms, no heartbeat and no acknowledgement (failure timeout {timeout_ms} ms)")]
    Silent { silence_ms: u64, timeout_ms: u64 },
    #[error("checkpoint {epoch} still unacknowledged {waited_ms} ms after it was sent, though the backup beats (acknowledgement timeout)")]
    Unacknowledged { epoch: u64, waited_ms: u64 },
    // What this primary could not do.
    #[error("sending checkpoint {epoch} failed: {err}")]
    Send { epoch: u64, err: std::io::Error },
    #[error("checkpoint {epoch} failed: {err}")]
    Checkpoint { epoch: u64, err: ReplicationError },
}
