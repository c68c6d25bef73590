//! `ftvm-rt`: the runtime of ftvm guest programs.
//!
//! A guest is a static `no_std` ELF that the VMM enters at `_start` on every
//! vCPU at once, at CPL3 with identity-mapped memory (see
//! `docs/guest-abi.md`). This crate turns that into an ordinary `main` on
//! vCPU 0 with a heap, a console, a clock and a fork-join helper for the
//! other vCPUs, and drivers for the VMM's virtio devices (`net`: a TCP/IP
//! stack over virtio-net; `blk`: a disk over virtio-blk):
//!
//! ```ignore
//! #![no_std]
//! #![no_main]
//! ftvm_rt::entry!(main);
//! fn main(args: &ftvm_rt::Args) -> i32 {
//!     ftvm_rt::println!("hello from {} vCPUs", args.vcpu_count);
//!     0
//! }
//! ```
#![no_std]

pub extern crate alloc;

pub use ftvm_abi as abi;
pub use smoltcp;
pub use spin;
pub use spin::{Mutex, MutexGuard, Once};

pub mod blk;
pub mod console;
mod heap;
mod hypercall;
mod mem;
pub mod net;
mod panic;
pub mod smp;
mod start;
pub mod time;
mod vcpu;
pub mod virtio;

pub use smp::run_on_all;
pub use start::{devices, Args};
pub use vcpu::{vcpu_count, vcpu_id};

/// Most vCPUs a guest supports (per-vCPU tables are sized by it).
pub const MAX_VCPUS: usize = 64;

/// End the VM with `status` (the VMM's exit status, truncated to 0..=255).
pub fn exit(status: i32) -> ! {
    hypercall::exit(status as i64 as u64);
    panic::park()
}

/// Wake every vCPU blocked in [`time::wait`].
pub fn kick() {
    hypercall::kick();
}

/// Define the program's entry point: `entry!(main)` with
/// `fn main(args: &ftvm_rt::Args) -> i32`. `main` runs on vCPU 0; its return
/// value becomes the VM's exit status.
#[macro_export]
macro_rules! entry {
    ($main:path) => {
        /// The VMM jumps here on every vCPU; see `ftvm_rt::start`.
        #[unsafe(no_mangle)]
        #[unsafe(naked)]
        pub unsafe extern "C" fn _start() -> ! {
            // The exact entry rsp (third argument) tells each vCPU where its
            // stack is; `jmp` keeps the call-like alignment the VMM set up.
            ::core::arch::naked_asm!(
                "mov rdx, rsp",
                "lea rcx, [rip + {main}]",
                "jmp {start}",
                main = sym __ftvm_rt_main,
                start = sym $crate::__start,
            )
        }

        fn __ftvm_rt_main(args: &$crate::Args) -> i32 {
            let main: fn(&$crate::Args) -> i32 = $main;
            main(args)
        }
    };
}

#[doc(hidden)]
pub use start::__start;
