//! Freeze: stop the VM, harvest what changed, save its state, close the
//! output epoch, all in one pause.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ftvm_vmm::{PageBitmap, Persist, Vm};

use super::predict::FreezeMask;
use crate::checkpoint::{CheckpointState, StateDelta};
use crate::error::ReplicationError;
use crate::fakeack::delta::Carried;
use crate::fakeack::FakeAck;
use crate::output::{DiskJournal, OutputBuffer};

/// The VM is paused while this lives; `thaw` resumes it (so does dropping it).
pub struct Frozen<'vm> {
    pause: Paused<'vm>,
    pub epoch: u64,
    /// Pages written since the previous freeze, by the guest or the VMM.
    pub dirty: PageBitmap,
    pub state: CheckpointState,
    /// How long `vm.pause()` took.
    stop: Duration,
}

/// What the freeze leaves for the stages after it.
pub struct Thawed {
    pub state: CheckpointState,
    pub figures: Figures,
}

/// What freezing the VM took.
#[derive(Clone, Copy, Debug, Default)]
pub struct Figures {
    /// How long the guest was stopped.
    pub pause: Duration,
    /// How long stopping it took (kicking the vCPUs out, parking them and
    /// the device threads) before `pause` started: the guest stops running
    /// somewhere in this interval, so its stop lies between `pause` and
    /// `pause + stop`.
    pub stop: Duration,
}

impl Frozen<'_> {
    /// Let the guest run again.
    pub fn thaw(self) -> Thawed {
        let Frozen { pause, state, stop, .. } = self;
        Thawed { state, figures: Figures { pause: pause.end(), stop } }
    }
}

struct Paused<'vm> {
    vm: &'vm Vm,
    since: Instant,
    resumed: bool,
}

impl Paused<'_> {
    fn end(mut self) -> Duration {
        self.vm.resume();
        self.resumed = true;
        self.since.elapsed()
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        if !self.resumed {
            self.vm.resume();
        }
    }
}

pub trait Freeze: Send {
    /// Pause `vm` and collect checkpoint `epoch`'s dirty set and state,
    /// leaving the pages `leave` chooses writable.
    fn freeze<'vm>(&mut self, vm: &'vm Vm, epoch: u64, leave: &mut dyn FreezeMask) -> Result<Frozen<'vm>, ReplicationError>;
}

/// Today's freeze: everything inside one pause.
pub struct PauseAndSave {
    output: Arc<OutputBuffer>,
    journal: Arc<DiskJournal>,
    ram_pages: u64,
    /// Scratch: the pages only a device wrote, at each freeze.
    device_written: PageBitmap,
    /// `--fake-ack`: its state goes with the VM's.
    fake_ack: Option<Arc<FakeAck>>,
}

impl PauseAndSave {
    pub fn new(ram_pages: u64, output: Arc<OutputBuffer>, journal: Arc<DiskJournal>) -> PauseAndSave {
        PauseAndSave { output, journal, ram_pages, device_written: PageBitmap::new(ram_pages), fake_ack: None }
    }

    /// Save `proxy`'s state with every checkpoint (or stop saving it).
    pub fn with_fake_ack(mut self, proxy: Option<Arc<FakeAck>>) -> PauseAndSave {
        self.fake_ack = proxy;
        self
    }
}

impl Freeze for PauseAndSave {
    fn freeze<'vm>(&mut self, vm: &'vm Vm, epoch: u64, leave: &mut dyn FreezeMask) -> Result<Frozen<'vm>, ReplicationError> {
        let asked = Instant::now();
        vm.pause();
        let pause = Paused { vm, since: Instant::now(), resumed: false };
        let stop = pause.since - asked;
        let mut dirty = PageBitmap::new(self.ram_pages);
        self.device_written.clear();
        let t0 = Instant::now();
        vm.harvest_dirty_by(&mut dirty, &mut self.device_written)?;
        let t1 = Instant::now();
        // From the guest's writes alone: a page only a device wrote (a
        // received frame, a used ring) cost no tracked first write, and
        // leaving it writable saves nothing.
        let keep = leave.choose(&dirty);
        let t2 = Instant::now();
        vm.rearm_dirty(keep)?;
        let t3 = Instant::now();
        dirty.or_words(self.device_written.words());
        // The proxy's state with the guest's, both at this instant: the
        // guest was told acknowledged exactly what the store holds beyond
        // the peer (the card is parked, no frame is halfway through).
        let fake_ack = self.fake_ack.as_ref().map(|p| Carried::Whole(p.save()));
        let vm_state = StateDelta::whole(vm.save()?);
        // Inside the pause: frames the guest sends after resuming belong to
        // the next epoch. The first checkpoint starts holding output.
        let output = if self.output.is_protected() {
            let closed = self.output.close_epoch();
            self.output.folded(closed)
        } else {
            self.output.protect(epoch + 1);
            Vec::new()
        };
        let state = CheckpointState { vm: vm_state, disk: self.journal.take(), fake_ack, output };
        tracing::debug!(
            stop_us = (t0 - pause.since).as_micros() as u64,
            harvest_us = (t1 - t0).as_micros() as u64,
            choose_us = (t2 - t1).as_micros() as u64,
            rearm_us = (t3 - t2).as_micros() as u64,
            save_us = t3.elapsed().as_micros() as u64,
            "freeze"
        );
        Ok(Frozen { pause, epoch, dirty, state, stop })
    }
}
