//! One state model for every component of a VM.
//!
//! vCPUs, devices (transport and model), the guest clock, guest memory and
//! the VM as a whole each say what their state is, how to save it and how
//! to load it back. The VM's own state is the tree of its components'
//! (`components`), which snapshots and checkpoints carry (plus the guest's
//! pages, see `pages`), so a component added later is saved everywhere by
//! implementing this once and giving it an id.

use serde::de::DeserializeOwned;
use serde::Serialize;

pub trait Persist {
    /// Everything needed to put the component back as it was.
    type State: Serialize + DeserializeOwned;
    type Error;

    /// Read the state; the VM is paused (or has not run).
    fn save(&self) -> Result<Self::State, Self::Error>;

    /// Load `state` into a component built with the same host
    /// configuration, before the VM runs. A state that does not fit this
    /// component (another device, another size) is an error, and leaves it
    /// unusable: callers discard the VM.
    fn restore(&mut self, state: &Self::State) -> Result<(), Self::Error>;
}

/// Encode a state for a snapshot or a checkpoint.
pub fn encode<T: Serialize>(state: &T) -> Vec<u8> {
    postcard::to_allocvec(state).expect("VM state serializes")
}

/// Decode a state; a malformed one is an error, never a panic.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(bytes)
}
