//! Who may use the control socket: its owner (the user the VMM runs as),
//! root, and with `--api-group NAME` the members of that group.
//!
//! Two locks, both needed: the socket file is created mode 0600 whatever
//! the umask (0660 and the group's with `--api-group`), so nobody else can
//! connect; and each connection's peer credentials (`SO_PEERCRED`) are
//! checked as it is accepted, so a socket whose mode was loosened later, or
//! a descriptor passed on to another process, still serves nobody else.
//! Whoever can use the socket can read all of guest memory (a snapshot), so
//! nothing less will do.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("--api-group {0}: no such group")]
    NoSuchGroup(String),
    #[error("--api-group {name}: cannot look the group up: {err}")]
    Lookup { name: String, err: io::Error },
}

/// The credentials of a connected client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub pid: libc::pid_t,
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
}

/// The group `--api-group` names, looked up at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub name: String,
    pub gid: libc::gid_t,
    /// Users listed as its members (whose primary group may be another).
    pub members: Vec<libc::uid_t>,
}

/// Who may use one control socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// The user the VMM runs as (after `--user`): the socket's owner.
    pub owner: libc::uid_t,
    pub group: Option<Group>,
}

impl Access {
    /// Whether a client with these credentials is served.
    pub fn allows(&self, peer: &Peer) -> bool {
        peer.uid == 0 || peer.uid == self.owner || self.group.as_ref().is_some_and(|g| peer.gid == g.gid || g.members.contains(&peer.uid))
    }

    /// Bind `path` with no moment at which others could connect: the umask
    /// is narrowed around `bind` (this runs while the VMM has one thread),
    /// then the file is given to its owner and group.
    pub fn bind(&self, path: &Path) -> io::Result<UnixListener> {
        // SAFETY: umask has no preconditions; it only sets the process's mask.
        let old = unsafe { libc::umask(0o177) };
        let bound = UnixListener::bind(path);
        // SAFETY: as above, restoring the previous mask.
        unsafe { libc::umask(old) };
        let listener = bound?;
        let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::other("a socket path with a NUL byte"))?;
        let gid = self.group.as_ref().map_or(libc::gid_t::MAX, |g| g.gid);
        // SAFETY: a NUL-terminated path; -1 (MAX) leaves the group as it is.
        if unsafe { libc::chown(c_path.as_ptr(), self.owner, gid) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if self.group.is_some() {
            // SAFETY: a NUL-terminated path.
            if unsafe { libc::chmod(c_path.as_ptr(), 0o660) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(listener)
    }
}

/// The credentials of the process at the other end of `stream`.
pub fn peer(stream: &UnixStream) -> io::Result<Peer> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` holds the
    // size of `cred`, as SO_PEERCRED expects.
    let r = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Peer { pid: cred.pid, uid: cred.uid, gid: cred.gid })
}

impl Group {
    /// Look `name` up in the group database (getgrnam_r).
    pub fn lookup(name: &str) -> Result<Group, AccessError> {
        let c_name = CString::new(name).map_err(|_| AccessError::NoSuchGroup(name.into()))?;
        let mut buf = vec![0u8; 64 * 1024];
        // SAFETY: all-zero bytes are a valid `group` (null pointers, gid 0);
        // getgrnam_r fills it in.
        let mut grp: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call: a NUL-terminated
        // name, `grp` and `found` on our stack, `buf` with its true length.
        let err = unsafe { libc::getgrnam_r(c_name.as_ptr(), &mut grp, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
        if err != 0 {
            return Err(AccessError::Lookup { name: name.into(), err: io::Error::from_raw_os_error(err) });
        }
        if found.is_null() {
            return Err(AccessError::NoSuchGroup(name.into()));
        }
        let mut members = Vec::new();
        let mut at = grp.gr_mem;
        // SAFETY: getgrnam_r left `gr_mem` a NULL-terminated array of
        // NUL-terminated strings inside `buf`, which lives until the end.
        unsafe {
            while !at.is_null() && !(*at).is_null() {
                let member = std::ffi::CStr::from_ptr(*at).to_string_lossy().into_owned();
                if let Ok(Some((uid, _))) = crate::privilege::ids_of(&member) {
                    members.push(uid);
                }
                at = at.add(1);
            }
        }
        Ok(Group { name: name.into(), gid: grp.gr_gid, members })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(group: Option<Group>) -> Access {
        Access { owner: 1000, group }
    }

    #[test]
    fn the_owner_and_root_are_served_and_nobody_else() {
        let a = access(None);
        assert!(a.allows(&Peer { pid: 1, uid: 1000, gid: 1000 }));
        assert!(a.allows(&Peer { pid: 1, uid: 0, gid: 0 }));
        assert!(!a.allows(&Peer { pid: 1, uid: 65534, gid: 65534 }));
        // The owner's group alone grants nothing.
        assert!(!a.allows(&Peer { pid: 1, uid: 1001, gid: 1000 }));
    }

    #[test]
    fn a_group_admits_its_primary_and_listed_members() {
        let a = access(Some(Group { name: "ops".into(), gid: 50, members: vec![1002] }));
        assert!(a.allows(&Peer { pid: 1, uid: 1001, gid: 50 }));
        assert!(a.allows(&Peer { pid: 1, uid: 1002, gid: 1002 }));
        assert!(!a.allows(&Peer { pid: 1, uid: 1003, gid: 1003 }));
    }

    #[test]
    fn groups_are_looked_up_by_name() {
        assert_eq!(Group::lookup("root").unwrap().gid, 0);
        assert!(matches!(Group::lookup("no-such-group-ftvm"), Err(AccessError::NoSuchGroup(_))));
    }

    #[test]
    fn a_socket_is_owner_only_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ftvm-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        // SAFETY: umask has no preconditions (unit tests share the process;
        // none else depends on the mask).
        let old = unsafe { libc::umask(0) };
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let bound = Access { owner: me, group: None }.bind(&path);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let _listener = bound.unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let client = UnixStream::connect(&path).unwrap();
        assert_eq!(peer(&client).unwrap().uid, me);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
