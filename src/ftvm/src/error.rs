//! What can stop a command of this binary: one enum, printed as the
//! `ftvm: error:` line before exit status 1.

use ftvm_replication::ReplicationError;
use ftvm_vmm::snapshot::SnapshotError;
use ftvm_vmm::VmError;

use crate::api::access::AccessError;
use crate::api::client::ClientError;
use crate::exporter::ExporterError;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Replication(#[from] ReplicationError),
    #[error("cannot serve control socket {path}: {err}")]
    Api { path: String, err: std::io::Error },
    #[error("{op}: {err}")]
    Os { op: &'static str, err: std::io::Error },
    #[error(transparent)]
    Metrics(#[from] ExporterError),
    #[error(transparent)]
    Seccomp(#[from] ftvm_vmm::seccomp::SeccompError),
    #[error(transparent)]
    Secret(#[from] ftvm_replication::pipeline::transport::SecretError),
    #[error(transparent)]
    Privilege(#[from] crate::privilege::PrivilegeError),
    #[error(transparent)]
    Access(#[from] AccessError),
    #[error("{0}")]
    Usage(String),
}

/// A system call's error as a [`RunError`] naming the operation.
pub fn os(op: &'static str) -> impl Fn(std::io::Error) -> RunError {
    move |err| RunError::Os { op, err }
}
