//! Primary-backup replication (Remus, with the papers' mechanisms as
//! pipeline stages): a primary checkpoints its VM to a backup every epoch
//! and holds each epoch's output until the backup has acknowledged it; the
//! backup applies checkpoints atomically and takes the VM over when the
//! primary disappears. Built on the replication core (`ftvm_replication`).

pub mod backup;
pub mod mirror;
pub mod primary;

pub use backup::{Backup, BackupConfig, Outcome};
pub use primary::{BackupLoss, Finished, LossPolicy, OnBackupLoss, Primary, PrimaryConfig, SessionOptions, DEFAULT_PIPELINE_DEPTH};
