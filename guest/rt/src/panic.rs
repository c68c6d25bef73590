//! Panics end the VM with ABORT. Nothing here takes the console lock, so a
//! panic while printing cannot deadlock.

use core::fmt::Write;
use core::panic::PanicInfo;

use crate::console::{BufWriter, Overflow};
use crate::hypercall;

#[panic_handler]
fn panic(info: &PanicInfo) -> ! {
    let mut w = BufWriter::<1024>::new(Overflow::Truncate);
    let _ = match info.location() {
        Some(l) => write!(w, "panicked at {}:{}:{}: {}", l.file(), l.line(), l.column(), info.message()),
        None => write!(w, "panicked: {}", info.message()),
    };
    hypercall::abort(w.as_bytes());
    park()
}

/// After EXIT/ABORT the VMM never resumes the vCPU; should it anyway, sleep
/// instead of running on. Uses the raw hypercall because the clock page may
/// be unknown and `vcpu_id` may be what panicked.
pub(crate) fn park() -> ! {
    let mut seen = 0;
    loop {
        seen = hypercall::wait(u64::MAX, seen);
    }
}
