//! The replication core of ftvm: what every way of replicating a VM is
//! built from. One checkpoint is a chain of stages (`pipeline`: trigger,
//! freeze, capture, encode, transport, apply), the frames they exchange
//! (`protocol`, `checkpoint`), output commit (`output`, `fakeack`),
//! failure detection (`liveness`), ownership (`arbiter`) and the figures
//! every role reports (`figures`, `metrics`, `telemetry`). The roles stand
//! on it: primary-backup (`ftvm_primary_backup`) and consensus-ordered
//! replicas (`ftvm_vsmr`); nothing here knows either.

pub mod announce;
pub mod arbiter;
pub mod bounds;
pub mod checkpoint;
pub mod consensus_status;
pub mod error;
pub mod fakeack;
pub mod fault;
pub mod figures;
pub mod handshakes;
pub mod liveness;
pub mod metrics;
pub mod output;
pub mod pipeline;
pub mod protocol;
pub mod refusals;
pub mod role;
pub mod sockopt;
pub mod telemetry;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;

pub use error::ReplicationError;
pub use metrics::{EpochMetrics, MetricsFile, Status, StatusCell};
pub use pipeline::Switches;
pub use protocol::{ProtocolError, PROTOCOL_VERSION};
pub use role::{identity, Role};
