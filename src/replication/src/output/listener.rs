//! Who hears what the output path holds, without the output path knowing
//! them: the trigger (an epoch's first held output, a journal near its
//! bound, both reasons to checkpoint early) and the mirror (a copy of each
//! held frame for the backup). Each implements only what it listens to.

/// Told of output as it is held.
pub trait OutputListener: Send + Sync {
    /// The open epoch holds its first output. Called with the buffer
    /// unlocked: a listener may look at the buffer.
    fn first_output_held(&self) {}
    /// The guest sent `frame`, held in `epoch`.
    fn frame_held(&self, _epoch: u64, _frame: &[u8]) {}
    /// Held disk writes reached the journal's early mark: a checkpoint is
    /// wanted as soon as possible.
    fn checkpoint_wanted(&self) {}
}
