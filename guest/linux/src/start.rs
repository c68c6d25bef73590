//! Process start-up: the initial stack ([`ftvm_elf::stack`]) in the stack
//! mapping, and the frame that enters the program (or its interpreter).

use alloc::string::String;
use alloc::vec::Vec;

use ftvm_elf::stack::{self, Start};

use crate::entry::Frame;
use crate::random;

/// Lay out the initial stack in `[bottom, top)` for a program started at
/// `entry` with the auxiliary entries `auxv`, and return the frame that
/// enters it.
pub fn initial_frame(
    entry: u64,
    auxv: &[(u64, u64)],
    argv: &[String],
    env: &[String],
    execfn: &str,
    bottom: u64,
    top: u64,
) -> Result<Frame, String> {
    let mut random_bytes = [0u8; 16];
    random::fill(&mut random_bytes);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let env: Vec<&str> = env.iter().map(String::as_str).collect();
    let start = Start { argv: &argv, env: &env, execfn, random: random_bytes, auxv };
    // SAFETY: [bottom, top) is the stack mapping, which belongs to the
    // program and is not in use while it is laid out.
    let mem = unsafe { core::slice::from_raw_parts_mut(bottom as *mut u8, (top - bottom) as usize) };
    let sp = stack::build(mem, top, &start).map_err(|_| String::from("the arguments and environment do not fit the initial stack"))?;
    Ok(Frame::initial(entry, sp))
}
