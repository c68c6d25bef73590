//! A primary (`ftvm run`, `ftvm restore` with `--replicate-to`): its VM
//! protected from its start, checkpointed to the backup; `ftvm status`
//! reports the replication.

use std::sync::Arc;

use ftvm_primary_backup::{Primary, PrimaryConfig};
use ftvm_replication::ReplicationError;

use crate::error::{os, RunError};
use crate::output::errln;
use crate::run::{Guest, HostOptions, OwnVm, Runtime};
use crate::signals;

pub fn run(guest: Guest, host: HostOptions, config: PrimaryConfig) -> Result<i32, RunError> {
    let (mut rt, vm) = Runtime::start(&host, Some(&guest))?;
    let vm = Arc::new(vm.expect("a guest's VM is built"));
    // Protected from its start: no output leaves before the backup has the
    // state behind it, not even while it is being reached.
    let plumbing = Primary::plumb(&vm, &config)?;
    plumbing.hold_from_start();
    vm.start().map_err(os("start vCPU threads"))?;
    rt.adopt(vm.clone())?;
    // A stop signal while the backup is brought up to date ends that.
    match Primary::start_plumbed(vm.clone(), config, plumbing, signals::stop_requested()) {
        Ok(p) => rt.protected_by(p),
        Err(ReplicationError::Stopped) => {
            vm.request_stop();
            vm.wait();
            errln!("ftvm: VM stopped while its backup was being brought up to date");
            return Ok(0);
        }
        Err(e) => {
            vm.request_stop();
            vm.wait();
            return Err(e.into());
        }
    }
    rt.serve(&mut OwnVm)
}
