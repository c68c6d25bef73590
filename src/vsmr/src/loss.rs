//! `--on-secondary-loss`: what a leader does while it has no synchronized
//! secondary (the secondary lost, or not brought up to date yet: at a
//! group's start and after every takeover until the first full `syncvm`).

use ftvm_vmm::switch;

switch! {
    /// `--on-secondary-loss`: the leader's choice while no other VM holds
    /// its state.
    pub enum OnSecondaryLoss {
        /// Each `syncvm` names no secondary (a consensus barrier) and
        /// releases the output held before it: the service runs on with
        /// one copy of the VM's state.
        Continue = "continue",
        /// The guest is paused and its output held (no barrier is
        /// proposed) until a full `syncvm` makes a replica the secondary;
        /// that `syncvm`'s acknowledgement releases the output, and the
        /// guest runs on, protected.
        Pause = "pause",
    }
}

/// `ftvm status`'s detail while the leader's guest is paused so.
pub const PAUSED: &str = "PAUSED: no synchronized secondary (--on-secondary-loss pause)";
