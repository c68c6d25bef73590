//! Dirty device-state tracking (`--device-state changed`): a component of
//! the VM's state (a vCPU's, a device's, the clock's, guest memory's: any
//! `ftvm_vmm::components` id) goes into a checkpoint only if its bytes
//! differ from what this primary last sent the backup; the backup keeps
//! the rest from the checkpoint before (`StateDelta::over`). Components are
//! compared by their encoding, so "unchanged" is exact, and by id, so a
//! component the VM gains is tracked with no change here.
//!
//! Every component is still saved in the pause (reading a vCPU's registers
//! is what tells whether they changed; KVM has no dirty bit for them); what
//! is saved is the bytes on the wire. A vCPU's time-stamp counter, which
//! moves on even while it is halted, is a component of its own, so a
//! halted vCPU sends only its counter.

use ftvm_vmm::Components;

use crate::checkpoint::StateDelta;
use ftvm_vmm::switch;

switch! {
    /// `--device-state`: which vCPU and device state a checkpoint carries.
    pub enum States {
        /// Every component, every checkpoint.
        All = "all",
        /// Only the components that changed since the previous checkpoint.
        Changed = "changed",
    }
}

/// What the backup holds of each component: what it was last sent.
pub struct SentState {
    mode: States,
    sent: Components,
}

impl SentState {
    pub fn new(mode: States) -> SentState {
        SentState { mode, sent: Components::default() }
    }

    /// A new backup: it has none of it.
    pub fn reset(&mut self) {
        self.sent = Components::default();
    }

    /// Move into `delta.kept` (from `delta.changed`, whole as saved) what
    /// the backup has already.
    pub fn filter(&mut self, delta: &mut StateDelta) {
        if self.mode == States::All {
            return;
        }
        let mut changed = Components::default();
        let mut now = Components::default();
        for (id, bytes) in std::mem::take(&mut delta.changed) {
            if self.sent.get(&id) == Some(bytes.as_slice()) {
                delta.kept.push(id.clone());
            } else {
                changed.insert(id.clone(), bytes.clone());
            }
            now.insert(id, bytes);
        }
        delta.changed = changed;
        // What the backup holds after this checkpoint: only the components
        // it names (`StateDelta::over`).
        self.sent = now;
    }
}

#[cfg(test)]
mod tests {
    use ftvm_vmm::persist::Persist;
    use ftvm_vmm::ComponentId;

    use super::*;

    /// A component the VM does not have: anything with a `Persist`.
    struct Fake(u32);

    impl Persist for Fake {
        type State = u32;
        type Error = std::convert::Infallible;

        fn save(&self) -> Result<u32, Self::Error> {
            Ok(self.0)
        }

        fn restore(&mut self, state: &u32) -> Result<(), Self::Error> {
            self.0 = *state;
            Ok(())
        }
    }

    fn saved(parts: &[(&str, u32)]) -> Components {
        let mut c = Components::default();
        for &(id, value) in parts {
            let Ok(()) = c.save(ComponentId::new(id), &Fake(value));
        }
        c
    }

    /// One checkpoint through the sender's filter, the wire and the
    /// backup's apply: what the backup then holds, and what was sent.
    fn send(sent: &mut SentState, base: Option<Components>, now: Components) -> (Components, StateDelta) {
        let mut delta = StateDelta::whole(now);
        sent.filter(&mut delta);
        let wire = postcard::to_allocvec(&delta).unwrap();
        let received: StateDelta = postcard::from_bytes(&wire).unwrap();
        received.check(base.as_ref()).unwrap();
        let carried = StateDelta { changed: received.changed.clone(), kept: received.kept.clone(), xored: received.xored.clone() };
        (received.over(base), carried)
    }

    #[test]
    fn a_new_component_is_sent_and_applied_and_an_unchanged_one_is_not_resent() {
        let mut sent = SentState::new(States::Changed);
        let first = saved(&[("clock", 1), ("vcpu/0", 5)]);
        let (backup, delta) = send(&mut sent, None, first.clone());
        assert_eq!((backup.clone(), delta.omitted()), (first, 0), "the first checkpoint carries everything");

        // A device this code has never heard of joins; the vCPU stays.
        let second = saved(&[("clock", 2), ("vcpu/0", 5), ("devices/fake0", 9)]);
        let (backup, delta) = send(&mut sent, Some(backup), second.clone());
        assert_eq!(backup, second, "the backup holds the new component");
        let changed: Vec<&str> = delta.changed.ids().map(ComponentId::as_str).collect();
        assert_eq!(changed, ["clock", "devices/fake0"]);
        assert_eq!(delta.kept, [ComponentId::new("vcpu/0")]);

        // Nothing changes but the clock: the device is not sent again.
        let third = saved(&[("clock", 3), ("vcpu/0", 5), ("devices/fake0", 9)]);
        let (backup, delta) = send(&mut sent, Some(backup), third.clone());
        assert_eq!(backup, third);
        assert_eq!(delta.changed.ids().map(ComponentId::as_str).collect::<Vec<_>>(), ["clock"]);
        let mut device = Fake(0);
        let Ok(()) = device.restore(&backup.state(&ComponentId::new("devices/fake0")).unwrap());
        assert_eq!(device.0, 9, "applied by id");

        // A new backup gets everything again.
        sent.reset();
        let (_, delta) = send(&mut sent, None, third);
        assert_eq!((delta.changed.len(), delta.omitted()), (3, 0));
    }

    #[test]
    fn every_component_goes_when_all_are_asked_for() {
        let mut sent = SentState::new(States::All);
        let state = saved(&[("clock", 1), ("vcpu/0", 5)]);
        let (backup, _) = send(&mut sent, None, state.clone());
        let (_, delta) = send(&mut sent, Some(backup), state);
        assert_eq!((delta.changed.len(), delta.omitted()), (2, 0));
    }

    #[test]
    fn a_delta_without_its_base_is_refused() {
        let mut sent = SentState::new(States::Changed);
        let state = saved(&[("clock", 1)]);
        let mut first = StateDelta::whole(state.clone());
        sent.filter(&mut first);
        let mut second = StateDelta::whole(state);
        sent.filter(&mut second);
        assert!(second.check(None).unwrap_err().contains("never received"));
        assert!(second.check(Some(&Components::default())).unwrap_err().contains("did not have"));
        second.changed = saved(&[("clock", 1)]);
        assert!(second.check(Some(&saved(&[("clock", 1)]))).unwrap_err().contains("both keeps and changes"));
    }
}
