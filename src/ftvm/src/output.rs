//! Lines for the user on stdout and stderr that survive a reader going away
//! (`ftvm run ... 2>&1 | head -1`): a write that fails (EPIPE) is dropped,
//! so the exit status stays the guest's or the command's, never a panic.
//! `println!` and `eprintln!` are denied in this crate (see `main.rs`).

use std::fmt::Arguments;
use std::io::Write;

/// A line on stdout, dropped if stdout is closed.
pub fn out(args: Arguments) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(args).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush());
}

/// A line on stderr, dropped if stderr is closed.
pub fn err(args: Arguments) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|_| err.write_all(b"\n"));
}

/// `println!` that tolerates a closed stdout.
macro_rules! outln {
    () => {
        $crate::output::out(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::output::out(format_args!($($arg)*))
    };
}

/// `eprintln!` that tolerates a closed stderr.
macro_rules! errln {
    () => {
        $crate::output::err(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::output::err(format_args!($($arg)*))
    };
}

pub(crate) use {errln, outln};
