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
pub mod heap;
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

/// Switch this vCPU to the page tables rooted at `root` (0: the VMM's
/// identity tables); see [`abi::AddressSpace`].
///
/// # Safety
/// As for the hypercall: `root`'s tables must map the system area as the
/// VMM's do and identity-map the caller's code, stack and data while loaded.
pub unsafe fn set_address_space(root: u64) {
    // SAFETY: the caller's promise is the hypercall's.
    unsafe { hypercall::set_address_space(root) }
}

/// Reflect this vCPU's CPL3 page faults to `handler` (see
/// [`ftvm_abi::FaultHandler`]); 0 restores the default (the VM stops).
///
/// # Safety
/// As [`hypercall::set_fault_handler`].
pub unsafe fn set_fault_handler(handler: u64, stack: u64) {
    // SAFETY: the caller's promise is the hypercall's.
    unsafe { hypercall::set_fault_handler(handler, stack) }
}

/// Wake every vCPU blocked in [`time::wait`].
pub fn kick() {
    hypercall::kick();
}

/// The ftvm ABI note (`ftvm_abi::note`) as it sits in the image: header,
/// name and descriptor with 4-byte ELF note alignment, so packed.
#[doc(hidden)]
#[repr(C, packed(4))]
pub struct AbiNote {
    pub namesz: u32,
    pub descsz: u32,
    pub kind: u32,
    pub name: [u8; 8],
    pub abi_version: u32,
    pub flags: u32,
    pub syscall_entry: Option<unsafe extern "C" fn()>,
}

impl AbiNote {
    #[doc(hidden)]
    pub const fn new(flags: u32, syscall_entry: Option<unsafe extern "C" fn()>) -> AbiNote {
        let n = abi::note::NAME;
        AbiNote {
            namesz: n.len() as u32,
            descsz: abi::note::DESC_SIZE as u32,
            kind: abi::note::TYPE_ABI,
            name: [n[0], n[1], n[2], n[3], n[4], 0, 0, 0],
            abi_version: abi::ABI_VERSION,
            flags,
            syscall_entry,
        }
    }
}

/// Define the program's entry point: `entry!(main)` with
/// `fn main(args: &ftvm_rt::Args) -> i32`. `main` runs on vCPU 0; its return
/// value becomes the VM's exit status. The image gets the ftvm ABI note.
///
/// `entry!(main, linux_syscall_entry = handler)` marks the image as a runtime
/// with a Linux personality: the VMM loads a Linux program next to it and
/// points `syscall` at `handler`.
#[macro_export]
macro_rules! entry {
    ($main:path) => {
        $crate::entry!(@note 0, None);
        $crate::entry!(@start $main);
    };
    ($main:path, linux_syscall_entry = $handler:path) => {
        $crate::entry!(@note $crate::abi::note::FLAG_LINUX_PERSONALITY, Some($handler));
        $crate::entry!(@start $main);
    };
    (@note $flags:expr, $handler:expr) => {
        #[used]
        #[unsafe(link_section = ".note.ftvm")]
        static __FTVM_ABI_NOTE: $crate::AbiNote = $crate::AbiNote::new($flags, $handler);
    };
    (@start $main:path) => {
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
