//! Console output: `print!`/`println!` format into a stack buffer and send
//! it with one CONSOLE_WRITE, holding a lock so lines from different vCPUs
//! never interleave.

use core::fmt::{self, Write};

use spin::Mutex;

use crate::hypercall;

/// Each hypercall costs a VM exit (~17 µs here), so batch up to this much.
const BUF_SIZE: usize = 512;

static LOCK: Mutex<()> = Mutex::new(());

/// A fixed buffer that flushes to the console when full, so long output is
/// split into several writes instead of truncated.
pub(crate) struct BufWriter<const N: usize> {
    buf: [u8; N],
    len: usize,
    overflow: Overflow,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overflow {
    Flush,
    Truncate,
}

impl<const N: usize> BufWriter<N> {
    pub(crate) fn new(overflow: Overflow) -> Self {
        BufWriter { buf: [0; N], len: 0, overflow }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    pub(crate) fn flush(&mut self) {
        if self.len > 0 {
            hypercall::console_write(self.as_bytes());
            self.len = 0;
        }
    }
}

impl<const N: usize> Write for BufWriter<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut bytes = s.as_bytes();
        while !bytes.is_empty() {
            if self.len == N {
                match self.overflow {
                    Overflow::Flush => self.flush(),
                    Overflow::Truncate => return Ok(()),
                }
            }
            let n = bytes.len().min(N - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
            self.len += n;
            bytes = &bytes[n..];
        }
        Ok(())
    }
}

/// Write raw bytes to the console (one hypercall, under the console lock).
pub fn write_bytes(bytes: &[u8]) {
    let _guard = LOCK.lock();
    hypercall::console_write(bytes);
}

#[doc(hidden)]
pub fn _print(args: fmt::Arguments) {
    let _guard = LOCK.lock();
    let mut w = BufWriter::<BUF_SIZE>::new(Overflow::Flush);
    // BufWriter itself never fails; an error here comes from a Display impl
    // and there is nobody to report it to, so print what we have.
    let _ = w.write_fmt(args);
    w.flush();
}

#[macro_export]
macro_rules! print {
    ($($arg:tt)*) => { $crate::console::_print(format_args!($($arg)*)) };
}

#[macro_export]
macro_rules! println {
    () => { $crate::console::_print(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::console::_print(format_args!("{}\n", format_args!($($arg)*))) };
}
