//! Workload kernels that run inside ftvm guests and, unchanged, on the host:
//! the guest prints a checksum, the host recomputes it to prove that memory
//! survived snapshots and failovers.
#![no_std]

pub mod memtouch;
