//! Runtime options: the words before `--` on the guest command line.
//!
//! | word | meaning |
//! |---|---|
//! | `ip=A.B.C.D/N`, `gw=A.B.C.D` | bring up the network (virtio-net) with this address |
//! | `epoch=SECONDS` | wall-clock time (CLOCK_REALTIME) at boot; default the host's wall clock |
//! | `rtmem=MIB` | memory the runtime keeps for itself; the program gets the rest |
//! | `disk=PATH` | mount the virtio-blk disk's file system at PATH (e.g. `/data`) |
//! | `cwd=PATH` | the program's working directory (default `/`, or the disk's mount point) |
//! | `vdso=on\|off` | give the program a vDSO for the clock calls (default on; see `vdso`) |
//! | `syscall=jmp\|trap` | rewrite the instruction before each `syscall` into a jump to a stub when it can (default, see `sysjmp`), or leave every `syscall` instruction trapping (for measuring) |
//! | `notify=exact\|eager` | notify the network device by the virtio event-index rule (default), or whenever the ring is past the device's event index, as before (for measuring) |

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use ftvm_rt::net::NetConfig;

/// How the program's `syscall` instructions reach the system-call entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyscallMode {
    /// As they are: each one traps to the hypervisor first.
    Trap,
    /// Sites rewritten into jumps to per-site stubs (`sysjmp`).
    Jmp,
}

pub struct Options {
    pub net: Option<NetConfig>,
    pub epoch_ns: Option<u64>,
    pub runtime_mem: Option<u64>,
    pub disk: Option<String>,
    pub cwd: Option<String>,
    pub vdso: bool,
    pub syscall: SyscallMode,
    /// The exact event-index rule for device notifications.
    pub exact_notify: bool,
}

impl Options {
    pub fn parse(words: &[String]) -> Result<Options, String> {
        let mut o = Options {
            net: None,
            epoch_ns: None,
            runtime_mem: None,
            disk: None,
            cwd: None,
            vdso: true,
            syscall: SyscallMode::Jmp,
            exact_notify: true,
        };
        let mut net_words: Vec<&str> = Vec::new();
        for w in words {
            let (k, v) = w.split_once('=').ok_or_else(|| format!("bad runtime option {w:?} (expected NAME=VALUE before --)"))?;
            let num = || v.parse::<u64>().map_err(|_| format!("bad {k}= value {v:?}"));
            match k {
                "ip" | "gw" => net_words.push(w),
                "epoch" => o.epoch_ns = Some(num()?.saturating_mul(1_000_000_000).min(u64::MAX - 1)),
                "rtmem" => o.runtime_mem = Some(num()?.checked_mul(1 << 20).ok_or("rtmem= too large")?),
                "disk" if v.starts_with('/') => o.disk = Some(v.trim_end_matches('/').to_string()),
                "cwd" if v.starts_with('/') => o.cwd = Some(v.to_string()),
                "disk" | "cwd" => return Err(format!("{k}= needs an absolute path")),
                "vdso" => o.vdso = on_off(k, v)?,
                "syscall" => {
                    o.syscall = match v {
                        "trap" => SyscallMode::Trap,
                        "jmp" => SyscallMode::Jmp,
                        _ => return Err(format!("bad syscall= value {v:?} (expected jmp or trap)")),
                    }
                }
                "notify" => {
                    o.exact_notify = match v {
                        "exact" => true,
                        "eager" => false,
                        _ => return Err(format!("bad notify= value {v:?} (expected exact or eager)")),
                    }
                }
                _ => return Err(format!("unknown runtime option {k}=")),
            }
        }
        if !net_words.is_empty() {
            o.net = Some(NetConfig::from_cmdline(&net_words.join(" ")).map_err(|e| e.to_string())?);
        }
        Ok(o)
    }
}

fn on_off(k: &str, v: &str) -> Result<bool, String> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("bad {k}= value {v:?} (expected on or off)")),
    }
}
