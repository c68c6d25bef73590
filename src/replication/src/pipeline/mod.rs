//! One checkpoint as a chain of stages with typed hand-offs:
//!
//! ```text
//!  primary                                                       backup
//!  Freeze ──Frozen──▶ Capture ──Captured──▶ Encode ──frame──▶ Transport ──▶ Apply
//!  (pause, dirty set,  (copy the pages      (PageEncoder per   (TCP)         (stage,
//!   state, output       as they were at      page, tagged)                    then commit)
//!   epoch)              the freeze)
//! ```
//!
//! Each stage is a trait with today's behaviour as its implementation; a
//! later mechanism (copy-on-write capture, XOR-diff encoding, a shared-memory
//! transport, a double-buffered apply) is one more implementation chosen by
//! a switch (`Switches`), so it can be measured on and off in one run.

pub mod apply;
pub mod capture;
pub mod encode;
pub mod freeze;
pub mod last_sent;
pub mod transport;
pub mod trigger;

use std::sync::Arc;
use std::time::Duration;

use ftvm_vmm::pages::PageEncoder;
use ftvm_vmm::Vm;

use crate::output::{DiskJournal, OutputBuffer};
use crate::protocol;
use crate::ReplicationError;
use capture::Capture;
use freeze::Freeze;

/// Which implementation each stage uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Switches {
    pub capture: capture::Mode,
    pub encoding: encode::Encoding,
    pub diff: encode::Diff,
    pub device_state: encode::States,
    pub transport: transport::Kind,
}

/// What taking one checkpoint cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct Taken {
    pub epoch: u64,
    pub pause: Duration,
    pub dirty_pages: u64,
    pub disk_writes: u64,
    /// Bytes of disk data the checkpoint carries.
    pub disk_bytes: u64,
    /// Taken before the end of its epoch, because a bound was reached (set
    /// by whoever triggered it).
    pub early: bool,
    /// Pages the checkpoint carries.
    pub commit_pages: u64,
    /// Bytes its pages took (entry headers included).
    pub page_bytes: u64,
    /// Bytes diffs saved against sending their pages whole.
    pub diff_bytes_saved: u64,
    /// Bytes of its state (VM state and disk writes).
    pub state_bytes: u64,
    /// Time spent encoding its pages.
    pub encode_ns: u64,
}

/// The primary's half of the pipeline: from the running VM to a frame.
pub struct Pipeline {
    freeze: Box<dyn Freeze>,
    capture: Box<dyn Capture>,
    encoder: Box<dyn PageEncoder>,
    sent_state: encode::SentState,
    frame: Vec<u8>,
    /// The largest checkpoint payload the backup accepts from this VM.
    limit: u64,
}

impl Pipeline {
    pub fn new(switches: &Switches, vm: &Vm, output: Arc<OutputBuffer>, journal: Arc<DiskJournal>) -> Pipeline {
        Pipeline {
            freeze: Box::new(freeze::PauseAndSave::new(vm.ram().pages(), output, journal)),
            capture: capture::new(switches.capture),
            encoder: encode::new(switches.encoding, switches.diff, vm.ram().pages()),
            sent_state: encode::SentState::new(switches.device_state),
            frame: Vec::new(),
            limit: crate::bounds::checkpoint_limit(vm.config().mem_size, vm.config().vcpus),
        }
    }

    /// The next checkpoint goes to a new backup, which has nothing but what
    /// pre-copy sent it: forget what was assumed about the previous one.
    pub fn new_backup(&mut self) {
        self.encoder.reset();
        self.sent_state.reset();
    }

    /// Take checkpoint `epoch`: the VM is paused only for the freeze (and
    /// whatever the capture does before the guest runs again). Returns the
    /// figures and the frame to send.
    pub fn take(&mut self, vm: &Vm, epoch: u64) -> Result<(Taken, &[u8]), ReplicationError> {
        let frozen = self.freeze.freeze(vm, epoch)?;
        let captured = self.capture.in_pause(vm, &frozen.dirty);
        let mut thawed = frozen.thaw();
        captured?;
        let pages = self.capture.finish(vm)?;
        self.sent_state.filter(&mut thawed.state.vm);
        let encoded = encode::checkpoint(&mut self.frame, epoch, &thawed.state, pages, self.encoder.as_mut());
        let bytes = protocol::payload_len(&self.frame);
        if bytes > self.limit {
            // The bounds make this impossible; sending it would make the backup give up on us.
            return Err(ReplicationError::CheckpointTooLarge { epoch, bytes, limit: self.limit });
        }
        let taken = Taken {
            epoch,
            pause: thawed.pause,
            dirty_pages: pages.len() as u64,
            disk_writes: thawed.state.disk.len() as u64,
            disk_bytes: thawed.state.disk.iter().map(|w| w.data.len() as u64).sum(),
            early: false,
            commit_pages: encoded.pages.pages,
            page_bytes: encoded.pages.bytes,
            diff_bytes_saved: encoded.pages.diff_saved,
            state_bytes: encoded.state_bytes,
            encode_ns: encoded.pages_ns,
        };
        Ok((taken, &self.frame))
    }
}
