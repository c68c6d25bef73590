//! `--user NAME`: run the VMM as an unprivileged user once what needs root
//! is open (`/dev/kvm`, the TAP, the disk, the control socket).
//!
//! The name is looked up before anything starts ([`User::lookup`]); the
//! drop itself ([`User::become_it`]) happens on the VMM's main thread while
//! it is the only thread, so that the credentials of the whole process
//! change at once (with other threads, glibc would make each of them change
//! its own, and their seccomp filters forbid that). Real, effective and
//! saved IDs all change and the supplementary groups are cleared: the
//! process can never become root again, and loses every capability.

use std::ffi::CString;

#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("--user {0}: no such user")]
    NoSuchUser(String),
    #[error("--user {name}: cannot look the user up: {err}")]
    Lookup { name: String, err: std::io::Error },
    #[error("--user {name}: only root can change to another user (ftvm runs as uid {uid})")]
    NotRoot { name: String, uid: libc::uid_t },
    #[error("--user {name}: {op} failed: {err}")]
    Change { name: String, op: &'static str, err: std::io::Error },
    #[error("--user {name}: the VMM already runs {threads} threads; credentials must change before any starts")]
    Threads { name: String, threads: usize },
}

/// The user to run as, looked up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
}

impl User {
    /// Look `name` up in the user database (getpwnam_r).
    pub fn lookup(name: &str) -> Result<User, PrivilegeError> {
        let (uid, gid) = ids_of(name)
            .map_err(|err| PrivilegeError::Lookup { name: name.into(), err })?
            .ok_or_else(|| PrivilegeError::NoSuchUser(name.into()))?;
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 && euid != uid {
            return Err(PrivilegeError::NotRoot { name: name.into(), uid: euid });
        }
        Ok(User { name: name.into(), uid, gid })
    }

    /// Become this user for good: no supplementary groups, then the group,
    /// then the user (real, effective and saved IDs).
    pub fn become_it(&self) -> Result<(), PrivilegeError> {
        let threads = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Threads:").and_then(|n| n.trim().parse().ok())))
            .unwrap_or(0);
        if threads != 1 {
            return Err(PrivilegeError::Threads { name: self.name.clone(), threads });
        }
        let change = |op, r: libc::c_int| match r {
            0 => Ok(()),
            _ => Err(PrivilegeError::Change { name: self.name.clone(), op, err: std::io::Error::last_os_error() }),
        };
        // SAFETY: plain system calls on this process's credentials; the
        // process has one thread (checked above), so they apply to all of it.
        unsafe {
            change("setgroups", libc::setgroups(0, std::ptr::null()))?;
            change("setresgid", libc::setresgid(self.gid, self.gid, self.gid))?;
            change("setresuid", libc::setresuid(self.uid, self.uid, self.uid))?;
        }
        tracing::info!(user = %self.name, uid = self.uid, gid = self.gid, "dropped privileges");
        Ok(())
    }
}

/// The uid and primary gid of user `name` (getpwnam_r); None if there is
/// no such user.
pub fn ids_of(name: &str) -> std::io::Result<Option<(libc::uid_t, libc::gid_t)>> {
    let Ok(c_name) = CString::new(name) else { return Ok(None) };
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: all-zero bytes are a valid `passwd` (null pointers, zero IDs);
    // getpwnam_r fills it in.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call: a NUL-terminated
    // name, `pwd` and `found` on our stack, `buf` with its true length.
    let err = unsafe { libc::getpwnam_r(c_name.as_ptr(), &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
    match (err, found.is_null()) {
        (0, true) => Ok(None),
        (0, false) => Ok(Some((pwd.pw_uid, pwd.pw_gid))),
        (err, _) => Err(std::io::Error::from_raw_os_error(err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_looked_up_by_name() {
        let root = User::lookup("root").unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(matches!(User::lookup("ftvm-no-such-user"), Err(PrivilegeError::NoSuchUser(_))));
        assert!(matches!(User::lookup("nul\0byte"), Err(PrivilegeError::NoSuchUser(_))));
    }
}
