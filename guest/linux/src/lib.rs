//! The parts of the Linux personality that are plain data structures,
//! kept apart from the `linux` binary so that they can be unit-tested on
//! the host (`cargo test -p ftvm-linux --lib`, see guest/README.md).
#![no_std]

extern crate alloc;
#[cfg(test)]
extern crate std;

pub mod errno;
pub mod mm;
pub mod ready_list;
