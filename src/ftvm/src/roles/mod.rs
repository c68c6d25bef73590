//! The roles a VMM runs in, one module each: what it starts on the shared
//! runtime (`run`), which events it adds, and what it reports. Each takes
//! its configuration ready-made (the command line's conversions, `cli`).

pub mod backup;
pub mod primary;
pub mod replica;
pub mod standalone;
pub mod witness;

use ftvm_primary_backup::PrimaryConfig;

use crate::error::RunError;
use crate::run::{Guest, HostOptions};

/// `ftvm run` and `ftvm restore`: a VM alone, or protected as a primary.
pub struct Launch {
    pub guest: Guest,
    pub host: HostOptions,
    /// `--replicate-to` and the options that go with it.
    pub replicate: Option<PrimaryConfig>,
}

impl Launch {
    pub fn run(self) -> Result<i32, RunError> {
        match self.replicate {
            Some(config) => primary::run(self.guest, self.host, config),
            None => standalone::run(self.guest, self.host),
        }
    }
}
