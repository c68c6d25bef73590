//! A VM alone (`ftvm run`, `ftvm restore` without `--replicate-to`): built,
//! started, served until it stops.

use std::sync::Arc;

use crate::error::{os, RunError};
use crate::run::{Guest, HostOptions, OwnVm, Runtime};

pub fn run(guest: Guest, host: HostOptions) -> Result<i32, RunError> {
    let (mut rt, vm) = Runtime::start(&host, Some(&guest))?;
    let vm = Arc::new(vm.expect("a guest's VM is built"));
    vm.start().map_err(os("start vCPU threads"))?;
    rt.adopt(vm)?;
    rt.serve(&mut OwnVm)
}
