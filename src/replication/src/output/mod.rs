//! Output commit: what the guest sends to the outside world is held per
//! epoch until the backup has the state behind it (`buffer`), and what it
//! writes to its disk travels with the epoch's checkpoint (`disk_journal`).
//! Both plug into the VMM through its hooks.

mod buffer;
mod disk_journal;
mod listener;

pub use buffer::{OutputBuffer, ReleaseGate, Released};
pub use disk_journal::{DiskJournal, DiskWrite};
pub use listener::OutputListener;
