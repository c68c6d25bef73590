//! The process start-up stack as the Linux kernel lays it out (System V
//! x86-64 ABI 3.4.1): from the top, the 16 random bytes of `AT_RANDOM`, the
//! platform string, the executable's name, the argument and environment
//! strings; below them, 16-byte aligned, argc, argv, NULL, envp, NULL and
//! the auxiliary vector ending in `AT_NULL`.

use alloc::vec::Vec;

pub const AT_NULL: u64 = 0;
pub const AT_PHDR: u64 = 3;
pub const AT_PHENT: u64 = 4;
pub const AT_PHNUM: u64 = 5;
pub const AT_PAGESZ: u64 = 6;
pub const AT_BASE: u64 = 7;
pub const AT_FLAGS: u64 = 8;
pub const AT_ENTRY: u64 = 9;
pub const AT_UID: u64 = 11;
pub const AT_EUID: u64 = 12;
pub const AT_GID: u64 = 13;
pub const AT_EGID: u64 = 14;
pub const AT_PLATFORM: u64 = 15;
pub const AT_HWCAP: u64 = 16;
pub const AT_CLKTCK: u64 = 17;
pub const AT_SECURE: u64 = 23;
pub const AT_RANDOM: u64 = 25;
pub const AT_HWCAP2: u64 = 26;
pub const AT_EXECFN: u64 = 31;
pub const AT_SYSINFO_EHDR: u64 = 33;

/// What goes on the stack besides the auxiliary entries the caller knows
/// (`AT_RANDOM`, `AT_PLATFORM` and `AT_EXECFN` point into the stack and
/// are added here).
pub struct Start<'a> {
    pub argv: &'a [&'a str],
    pub env: &'a [&'a str],
    /// The path that was executed (`AT_EXECFN`).
    pub execfn: &'a str,
    pub random: [u8; 16],
    pub auxv: &'a [(u64, u64)],
}

/// The stack does not hold the arguments and environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooBig;

/// Writes downwards in `mem`, whose end is at address `top`.
struct Down<'m> {
    mem: &'m mut [u8],
    top: u64,
    at: usize,
}

impl Down<'_> {
    fn push(&mut self, bytes: &[u8]) -> Result<u64, TooBig> {
        self.at = self.at.checked_sub(bytes.len()).ok_or(TooBig)?;
        self.mem[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        Ok(self.addr())
    }

    fn push_str(&mut self, s: &str) -> Result<u64, TooBig> {
        self.push(&[0])?;
        self.push(s.as_bytes())
    }

    fn addr(&self) -> u64 {
        self.top - (self.mem.len() - self.at) as u64
    }
}

/// Lay out `start` at the top of `mem` (the bytes below address `top`) and
/// return the initial stack pointer (pointing at argc).
pub fn build(mem: &mut [u8], top: u64, start: &Start) -> Result<u64, TooBig> {
    let at = mem.len();
    let mut d = Down { mem, top, at };
    let random = d.push(&start.random)?;
    let platform = d.push_str("x86_64")?;
    let execfn = d.push_str(start.execfn)?;
    let argv = start.argv.iter().map(|a| d.push_str(a)).collect::<Result<Vec<u64>, _>>()?;
    let env = start.env.iter().map(|e| d.push_str(e)).collect::<Result<Vec<u64>, _>>()?;
    let mut words: Vec<u64> = Vec::with_capacity(3 + argv.len() + env.len() + 2 * (start.auxv.len() + 4));
    words.push(argv.len() as u64);
    words.extend(&argv);
    words.push(0);
    words.extend(&env);
    words.push(0);
    for &(k, v) in start.auxv.iter().chain(&[(AT_RANDOM, random), (AT_PLATFORM, platform), (AT_EXECFN, execfn), (AT_NULL, 0)]) {
        words.extend([k, v]);
    }
    // rsp is 16-byte aligned at argc.
    let sp = d.addr().checked_sub(8 * words.len() as u64).ok_or(TooBig)? & !15;
    let off = usize::try_from(sp.checked_sub(top - d.mem.len() as u64).ok_or(TooBig)?).map_err(|_| TooBig)?;
    for (i, w) in words.iter().enumerate() {
        d.mem[off + 8 * i..off + 8 * i + 8].copy_from_slice(&w.to_le_bytes());
    }
    Ok(sp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::String;
    use alloc::vec;

    fn word(mem: &[u8], base: u64, addr: u64) -> u64 {
        let o = (addr - base) as usize;
        u64::from_le_bytes(mem[o..o + 8].try_into().unwrap())
    }

    fn string(mem: &[u8], base: u64, addr: u64) -> String {
        let o = (addr - base) as usize;
        let end = mem[o..].iter().position(|&b| b == 0).unwrap();
        String::from_utf8(mem[o..o + end].to_vec()).unwrap()
    }

    #[test]
    fn the_stack_holds_argc_argv_env_and_auxv() {
        let (top, len) = (0x10_0000u64, 4096usize);
        let base = top - len as u64;
        let mut mem = vec![0u8; len];
        let start = Start {
            argv: &["/bin/prog", "-x"],
            env: &["A=1"],
            execfn: "/bin/prog",
            random: [9; 16],
            auxv: &[(AT_PAGESZ, 4096), (AT_BASE, 0x7000_0000)],
        };
        let sp = build(&mut mem, top, &start).unwrap();
        assert_eq!(sp % 16, 0);
        assert_eq!(word(&mem, base, sp), 2);
        assert_eq!(string(&mem, base, word(&mem, base, sp + 8)), "/bin/prog");
        assert_eq!(string(&mem, base, word(&mem, base, sp + 16)), "-x");
        assert_eq!(word(&mem, base, sp + 24), 0);
        assert_eq!(string(&mem, base, word(&mem, base, sp + 32)), "A=1");
        assert_eq!(word(&mem, base, sp + 40), 0);
        let mut auxv = vec![];
        let mut at = sp + 48;
        loop {
            let (k, v) = (word(&mem, base, at), word(&mem, base, at + 8));
            auxv.push((k, v));
            at += 16;
            if k == AT_NULL {
                break;
            }
        }
        assert_eq!(&auxv[..2], &[(AT_PAGESZ, 4096), (AT_BASE, 0x7000_0000)]);
        let get = |key| auxv.iter().find(|&&(k, _)| k == key).unwrap().1;
        let r = (get(AT_RANDOM) - base) as usize;
        assert_eq!(&mem[r..r + 16], &[9; 16]);
        assert_eq!(string(&mem, base, get(AT_PLATFORM)), "x86_64");
        assert_eq!(string(&mem, base, get(AT_EXECFN)), "/bin/prog");
        assert_eq!(auxv.last(), Some(&(AT_NULL, 0)));
    }

    #[test]
    fn a_stack_too_small_is_refused() {
        let mut mem = vec![0u8; 64];
        let start = Start { argv: &["/a/long/program/name"], env: &[], execfn: "/a/long/program/name", random: [0; 16], auxv: &[] };
        assert_eq!(build(&mut mem, 0x1000, &start), Err(TooBig));
    }
}
