//! A consensus-ordered VM replica (`ftvm replica --image`): its guest takes
//! input from the raft log; `ftvm status` reports the group.

use std::sync::Arc;

use ftvm_vsmr::ReplicaConfig;

use crate::error::{os, RunError};
use crate::run::{Guest, HostOptions, OwnVm, Runtime};

/// `ftvm replica`: a VM replica, or without a VM a witness.
pub struct Member {
    pub config: ReplicaConfig,
    /// The VM (`--image`); none: a witness.
    pub guest: Option<Guest>,
    pub host: HostOptions,
}

impl Member {
    pub fn run(self) -> Result<i32, RunError> {
        let Some(guest) = self.guest else { return super::witness::run(self.config, self.host) };
        let (mut rt, vm) = Runtime::start(&self.host, Some(&guest))?;
        let vm = Arc::new(vm.expect("a guest's VM is built"));
        // A VSMR replica's guest takes input from the log; its TAP is read
        // only while it leads (from its first pass on).
        vm.devices().set_host_input(false);
        vm.start().map_err(os("start vCPU threads"))?;
        rt.adopt(vm.clone())?;
        rt.report_replica(ftvm_vsmr::start(self.config, Some(vm))?);
        rt.serve(&mut OwnVm)
    }
}
