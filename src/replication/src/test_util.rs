//! What unit tests across this crate share.

use std::sync::Mutex;

use ftvm_vmm::hooks::FrameSink;
use ftvm_vmm::sync::Lock;

/// A network that keeps every frame sent to it, in order.
#[derive(Default)]
pub struct Wire(pub Mutex<Vec<Vec<u8>>>);

impl FrameSink for Wire {
    fn send(&self, frame: &[u8]) {
        self.0.locked().push(frame.to_vec());
    }
}
