//! The witness (`ftvm replica --witness` without a VM): votes and keeps the
//! log, runs no VM; it ends only when stopped.

use ftvm_vsmr::ReplicaConfig;

use crate::error::RunError;
use crate::run::{HostOptions, Role, Runtime};

struct Witness;

impl Role for Witness {
    fn stopped_without_vm(&self) -> &'static str {
        "ftvm: witness stopped"
    }
}

pub fn run(config: ReplicaConfig, host: HostOptions) -> Result<i32, RunError> {
    let (mut rt, _) = Runtime::start(&host, None)?;
    rt.report_replica(ftvm_vsmr::start(config, None)?);
    rt.serve(&mut Witness)
}
