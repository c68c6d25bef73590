//! Where guest console output goes.

use std::io::Write;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
pub enum Console {
    /// The VMM's standard output (the normal case for `ftvm run`).
    #[default]
    Stdout,
    /// An in-memory buffer (tests and benchmarks read it back).
    Capture(Arc<Mutex<Vec<u8>>>),
}

impl Console {
    pub fn capture() -> (Console, Arc<Mutex<Vec<u8>>>) {
        let buf = Arc::new(Mutex::new(Vec::new()));
        (Console::Capture(buf.clone()), buf)
    }

    pub fn write(&self, bytes: &[u8]) {
        match self {
            Console::Stdout => {
                let mut out = std::io::stdout().lock();
                // A closed stdout must not stop the guest.
                let _ = out.write_all(bytes).and_then(|_| out.flush());
            }
            Console::Capture(buf) => buf.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(bytes),
        }
    }
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Console::Stdout => "Console::Stdout",
            Console::Capture(_) => "Console::Capture",
        })
    }
}
