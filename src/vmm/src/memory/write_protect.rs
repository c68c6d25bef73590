//! Write protection of guest RAM pages through userfaultfd, for a
//! copy-on-write capture: protected pages can be read by everyone, and a
//! write to one (by a vCPU through KVM or by a VMM thread) waits until the
//! page is unprotected, while this side is told which page it was.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

use userfaultfd::{Event, FaultKind, FeatureFlags, RegisterMode, Uffd, UffdBuilder};
use vmm_sys_util::eventfd::EventFd;

use super::{GuestRam, PAGE};

#[derive(Debug, thiserror::Error)]
pub enum WriteProtectError {
    #[error("userfaultfd is not available: {0}")]
    Create(String),
    #[error("cannot register guest memory for write protection: {0}")]
    Register(String),
    #[error("write protection of pages {first}..{end} failed: {err}")]
    Protect { first: u64, end: u64, err: String },
    #[error("reading write faults failed: {0}")]
    Read(String),
}

/// Guest RAM registered for write protection.
pub struct WriteProtect {
    uffd: Uffd,
    base: usize,
    pages: u64,
    /// Written to make `next_fault` return `None`.
    stop: EventFd,
}

impl WriteProtect {
    pub fn new(ram: &GuestRam) -> Result<WriteProtect, WriteProtectError> {
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            // Guest writes arrive through KVM's own accesses too (kernel mode).
            .user_mode_only(false)
            .require_features(FeatureFlags::PAGEFAULT_FLAG_WP)
            .create()
            .map_err(|e| WriteProtectError::Create(e.to_string()))?;
        let base = ram.host_base() as usize;
        uffd.register_with_mode(base as *mut _, ram.size() as usize, RegisterMode::WRITE_PROTECT)
            .map_err(|e| WriteProtectError::Register(e.to_string()))?;
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| WriteProtectError::Create(e.to_string()))?;
        Ok(WriteProtect { uffd, base, pages: ram.pages(), stop })
    }

    fn range(&self, first: u64, count: u64) -> Result<(*mut libc::c_void, usize), WriteProtectError> {
        match first.checked_add(count) {
            Some(end) if end <= self.pages => Ok(((self.base + first as usize * PAGE) as *mut _, count as usize * PAGE)),
            _ => Err(WriteProtectError::Protect { first, end: first.saturating_add(count), err: "beyond guest RAM".into() }),
        }
    }

    /// Protect pages `first..first + count` against writes. They must be
    /// populated (a page never written has nothing to protect).
    pub fn protect(&self, first: u64, count: u64) -> Result<(), WriteProtectError> {
        let (addr, len) = self.range(first, count)?;
        self.uffd.write_protect(addr, len).map_err(|e| WriteProtectError::Protect { first, end: first + count, err: e.to_string() })
    }

    /// Lift the protection of pages `first..first + count` and wake the
    /// threads waiting to write them.
    pub fn unprotect(&self, first: u64, count: u64) -> Result<(), WriteProtectError> {
        let (addr, len) = self.range(first, count)?;
        self.uffd.remove_write_protection(addr, len, true).map_err(|e| WriteProtectError::Protect {
            first,
            end: first + count,
            err: e.to_string(),
        })
    }

    /// Host address of `page` (for reading it while it is protected).
    pub fn page_ptr(&self, page: u64) -> Option<*const u8> {
        (page < self.pages).then(|| (self.base + page as usize * PAGE) as *const u8)
    }

    /// Wait for the next write to a protected page: its page number, or
    /// `None` once `stop` was called.
    pub fn next_fault(&self) -> Result<Option<u64>, WriteProtectError> {
        loop {
            let mut fds = [
                libc::pollfd { fd: self.uffd.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: two valid pollfds for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(WriteProtectError::Read(err.to_string()));
            }
            if fds[1].revents != 0 {
                return Ok(None);
            }
            match self.uffd.read_event().map_err(|e| WriteProtectError::Read(e.to_string()))? {
                Some(Event::Pagefault { kind: FaultKind::WriteProtected, addr, .. }) => {
                    return Ok(Some((addr as usize - self.base) as u64 / PAGE as u64));
                }
                // Nothing else is registered for; a spurious wakeup reads nothing.
                _ => continue,
            }
        }
    }

    /// Make `next_fault` return `None` (from now on).
    pub fn stop(&self) {
        let _ = self.stop.write(1);
    }
}
