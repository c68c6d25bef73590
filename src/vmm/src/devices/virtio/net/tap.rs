//! A TAP device carrying frames with the 12-byte virtio-net header, so
//! guest buffers pass to and from the kernel without header rewriting.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref, ioctl_with_val};
use vmm_sys_util::ioctl_iow_nr;

ioctl_iow_nr!(TUNSETIFF, b'T' as u32, 202, libc::c_int);
ioctl_iow_nr!(TUNSETVNETHDRSZ, b'T' as u32, 216, libc::c_int);
ioctl_iow_nr!(TUNSETOFFLOAD, b'T' as u32, 208, libc::c_uint);

/// `TUNSETOFFLOAD` flag: the kernel may hand us frames whose TCP/UDP
/// checksum is left partial (the virtio-net header's NEEDS_CSUM).
pub const TUN_F_CSUM: libc::c_uint = 0x01;

/// Size of `virtio_net_hdr_v1`, which VERSION_1 devices always use.
pub const VNET_HDR_LEN: usize = 12;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("TAP interface name '{0}' is empty or longer than 15 bytes")]
    BadName(String),
    #[error("cannot open /dev/net/tun: {0}")]
    OpenTun(io::Error),
    #[error("cannot attach to TAP '{name}': {err}")]
    Attach { name: String, err: io::Error },
    #[error("cannot bring TAP '{name}' up: {err}")]
    Up { name: String, err: io::Error },
    #[error("cannot set the offloads of TAP '{name}': {err}")]
    Offload { name: String, err: io::Error },
}

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl IfReq {
    fn new(name: &str) -> IfReq {
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        req
    }
}

pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attach to TAP `name`, creating it (and bringing it up) if absent.
    pub fn open(name: &str) -> Result<Tap, TapError> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(TapError::BadName(name.into()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::OpenTun)?;
        let attach = |err| TapError::Attach { name: name.into(), err };
        let mut req = IfReq::new(name);
        req.flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid out as.
        if unsafe { ioctl_with_mut_ref(&file, TUNSETIFF(), &mut req) } < 0 {
            return Err(attach(io::Error::last_os_error()));
        }
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int.
        if unsafe { ioctl_with_ref(&file, TUNSETVNETHDRSZ(), &hdr_len) } < 0 {
            return Err(attach(io::Error::last_os_error()));
        }
        set_up(name).map_err(|err| TapError::Up { name: name.into(), err })?;
        Ok(Tap { file, name: name.into() })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the kernel may leave undone in the frames it hands us
    /// (`TUN_F_*`): the guest's driver negotiated to accept that.
    pub fn set_offload(&self, flags: libc::c_uint) -> Result<(), TapError> {
        // SAFETY: TUNSETOFFLOAD takes its flags as the argument itself.
        if unsafe { ioctl_with_val(&self.file, TUNSETOFFLOAD(), flags.into()) } < 0 {
            return Err(TapError::Offload { name: self.name.clone(), err: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// Read one frame (with its virtio-net header); `WouldBlock` when none.
    pub fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read(buf)
    }

    /// A second handle for writing frames from another thread.
    pub fn try_clone_file(&self) -> Result<File, TapError> {
        self.file.try_clone().map_err(|err| TapError::Attach { name: self.name.clone(), err })
    }

    /// Discard frames queued while nobody was reading (a backup's TAP
    /// before takeover holds stale traffic).
    pub fn drain(&mut self) {
        let mut buf = [0u8; 2048];
        while self.file.read(&mut buf).is_ok_and(|n| n > 0) {}
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Set IFF_UP on interface `name` (a persistent TAP made by a script may be
/// up already; one we create is down).
fn set_up(name: &str) -> io::Result<()> {
    // SAFETY: plain socket creation, result checked.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `sock` is a fresh descriptor we own.
    let sock = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(sock) };
    let mut req = IfReq::new(name);
    // SAFETY: SIOCGIFFLAGS fills the flags of an ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if req.flags & libc::IFF_UP as libc::c_short == 0 {
        req.flags |= libc::IFF_UP as libc::c_short;
        // SAFETY: SIOCSIFFLAGS reads an ifreq.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}
