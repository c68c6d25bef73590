//! `--prefetch-by pull`: the backup reads the prefetched pages itself.
//!
//! A pull round harvests and re-arms exactly as a push round, then sends
//! the backup only the list of its write-cold pages (`PullList`, over the
//! replication link and so authenticated like the rest of it). The backup
//! reads them from a read-only mapping of the primary's guest memfd, a
//! true one-sided read (the primary does nothing for it: no copy, no
//! encoding, no bytes on the link), stages them as it stages pushed
//! pages, and confirms the list (`PullDone`).
//!
//! A read after the re-arm is safe while the epoch is open (a page written
//! after it is reported again and goes again), not once it froze: the
//! resumed guest may write a listed page in the next epoch, and the backup
//! would stage that newer content for the older checkpoint. So the freeze
//! (the guest paused) adds every page of a list whose confirmation has not
//! arrived to the checkpoint's dirty set (`Lists::close`): the checkpoint
//! carries it, and is applied after the staged pages. A confirmation that
//! arrived before the pause was sent after the read, so the read was in
//! the open epoch.
//!
//! The memfd is handed over once per backup, on one host only: the primary
//! binds an abstract Unix socket with a random name, sends the name over
//! the link (`PullMap`), and passes the memfd (SCM_RIGHTS) to the first
//! peer that runs as the same user (`SO_PEERCRED`); the backup, likewise,
//! takes it only from a peer of its own user. A process of that user can
//! read either side's memory anyway (`/proc/PID/mem`), so this exposes
//! nothing new; other users are refused. Where RDMA verbs exist, a remote
//! one-sided read of a registered region would take the mapping's place.

use std::fmt::Write as _;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::PageBitmap;

use crate::protocol::{self, Kind, PullList};
use ftvm_vmm::switch;

switch! {
    /// `--prefetch-by`: how the pages of `--prefetch` rounds reach the backup.
    pub enum By {
        /// The primary reads them and sends them over the link.
        Push = "push",
        /// The primary sends their numbers; the backup, on the same host,
        /// reads them from a read-only mapping of the primary's guest memory.
        Pull = "pull",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("cannot offer the guest memory on a Unix socket: {0}")]
    Listen(io::Error),
    #[error("the backup did not take the guest memory within {0:?} (--prefetch-by pull needs the backup on this host)")]
    NotTaken(Duration),
    #[error("cannot pass the guest memory to the backup: {0}")]
    Pass(io::Error),
    #[error("cannot reach the primary's memory socket (--prefetch-by pull needs the primary on this host and in the same network namespace: its socket is an abstract one): {0}")]
    Connect(io::Error),
    #[error("the primary's memory socket is held by uid {peer}, this backup runs as uid {me}")]
    Stranger { peer: u32, me: u32 },
    #[error("cannot receive the primary's guest memory: {0}")]
    Receive(io::Error),
    #[error("the primary's guest memory has {found} bytes, this replica {expected}")]
    Size { found: u64, expected: u64 },
    #[error("cannot map the primary's guest memory: {0}")]
    Map(io::Error),
}

/// The primary's side of the hand-over of its guest memory to one backup.
pub struct Offer {
    listener: UnixListener,
    name: String,
}

impl Offer {
    /// Bind an abstract Unix socket with a fresh random name.
    pub fn new() -> Result<Offer, PullError> {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| PullError::Listen(io::Error::other(e.to_string())))?;
        let mut name = String::from("ftvm-pull-");
        for b in nonce {
            // Writing to a String cannot fail.
            let _ = write!(name, "{b:02x}");
        }
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(PullError::Listen)?;
        let listener = UnixListener::bind_addr(&addr).map_err(PullError::Listen)?;
        listener.set_nonblocking(true).map_err(PullError::Listen)?;
        Ok(Offer { listener, name })
    }

    /// What the backup connects to (`PullMap`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Pass `memfd` to the first peer of this process's user within
    /// `timeout`; peers of other users are turned away.
    pub fn serve(&self, memfd: &File, timeout: Duration) -> Result<(), PullError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let peer = peer_uid(&stream).map_err(PullError::Pass)?;
                    let me = own_uid();
                    if peer != me {
                        tracing::warn!(peer, "turned away a peer of another user on the guest-memory socket");
                        continue;
                    }
                    stream.set_nonblocking(false).map_err(PullError::Pass)?;
                    return send_fd(&stream, memfd.as_raw_fd()).map_err(PullError::Pass);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(PullError::NotTaken(timeout));
                    }
                    wait_readable(self.listener.as_raw_fd(), left.min(Duration::from_millis(100)));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(PullError::Pass(e)),
            }
        }
    }
}

/// The backup's read-only view of the primary's guest memory.
pub struct PrimaryRam {
    base: *const u8,
    size: u64,
}

// SAFETY: the mapping is read-only and only read through `read_page`, which
// copies; it lives as long as `self`.
unsafe impl Send for PrimaryRam {}

impl PrimaryRam {
    /// Connect to the primary's socket `name`, take its memfd and map its
    /// `size` bytes read-only.
    pub fn map(name: &str, size: u64, timeout: Duration) -> Result<PrimaryRam, PullError> {
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(PullError::Connect)?;
        let stream = UnixStream::connect_addr(&addr).map_err(PullError::Connect)?;
        let (peer, me) = (peer_uid(&stream).map_err(PullError::Receive)?, own_uid());
        if peer != me {
            return Err(PullError::Stranger { peer, me });
        }
        stream.set_read_timeout(Some(timeout)).map_err(PullError::Receive)?;
        let memfd = File::from(recv_fd(&stream).map_err(PullError::Receive)?);
        let found = memfd.metadata().map_err(PullError::Receive)?.len();
        if found != size {
            return Err(PullError::Size { found, expected: size });
        }
        // SAFETY: a fresh shared read-only mapping of the whole memfd; the
        // result is checked, and unmapped only in Drop.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), size as usize, libc::PROT_READ, libc::MAP_SHARED, memfd.as_raw_fd(), 0) };
        if base == libc::MAP_FAILED {
            return Err(PullError::Map(io::Error::last_os_error()));
        }
        // The mapping keeps the memory; the descriptor is not needed.
        Ok(PrimaryRam { base: base as *const u8, size })
    }

    pub fn pages(&self) -> u64 {
        self.size / PAGE as u64
    }

    /// Copy page `page` (inside the mapping) as it is now into `out`. The
    /// primary's guest may be writing it: a torn copy is never committed
    /// (the page is reported dirty again and the checkpoint carries it).
    pub fn read_page(&self, page: u64, out: &mut [u8]) {
        assert!(page < self.pages() && out.len() >= PAGE, "page {page} is outside the primary's memory");
        // SAFETY: the page lies inside the live read-only mapping (checked
        // above) and `out` holds a page; a concurrent write by the primary's
        // guest only makes the copy torn, which the protocol accounts for.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(page as usize * PAGE), out.as_mut_ptr(), PAGE) }
    }
}

impl Drop for PrimaryRam {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`, which nothing
        // borrows past `self`.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.size as usize) };
    }
}

/// The primary's lists of one epoch and the backup's confirmations.
pub struct Lists {
    next: u64,
    /// Sent in the open epoch: each list's number and pages.
    open: Vec<(u64, Vec<u64>)>,
    /// The highest list number the backup confirmed (the acknowledgement
    /// reader sets it; the backup reads lists in order).
    confirmed: Arc<AtomicU64>,
}

impl Default for Lists {
    fn default() -> Lists {
        Lists { next: 1, open: Vec::new(), confirmed: Arc::new(AtomicU64::new(0)) }
    }
}

impl Lists {
    /// Where the acknowledgement reader records `PullDone`.
    pub fn confirmations(&self) -> Arc<AtomicU64> {
        self.confirmed.clone()
    }

    /// The `PullList` frame, into `frame`, of `pages` of the open epoch `epoch`.
    pub fn list(&mut self, frame: &mut Vec<u8>, epoch: u64, pages: &PageBitmap) {
        let msg = PullList { epoch, list: self.next, pages: pages.pages().collect() };
        self.next += 1;
        *frame = protocol::message(Kind::PullList, &msg);
        self.open.push((msg.list, msg.pages));
    }

    /// At the freeze, the guest paused: add the pages of every list not
    /// confirmed by now to the checkpoint's dirty set (the backup may read
    /// them after the guest resumes). Returns how many pages that added.
    pub fn close(&mut self, dirty: &mut PageBitmap) -> u64 {
        let confirmed = self.confirmed.load(Ordering::Acquire);
        let mut added = 0;
        for (_, pages) in self.open.drain(..).filter(|(list, _)| *list > confirmed) {
            added += pages.len() as u64;
            pages.into_iter().for_each(|p| dirty.set(p));
        }
        added
    }

    /// A new backup: nothing of the old one's lists counts.
    pub fn reset(&mut self) {
        self.open.clear();
    }
}

fn own_uid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// The user of the process at the other end of `stream` (as the kernel
/// recorded it at connect or listen).
fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of `len` bytes at a valid pointer.
    let r = unsafe { libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &raw mut len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

fn wait_readable(fd: RawFd, at_most: Duration) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; the result only says whether to try again.
    unsafe { libc::poll(&raw mut p, 1, at_most.as_millis().max(1) as i32) };
}

/// Room for one descriptor's control message.
const CMSG_ROOM: usize = 64;

/// Send `fd` over `stream` (SCM_RIGHTS) with one byte of data.
fn send_fd(stream: &UnixStream, fd: RawFd) -> io::Result<()> {
    let mut byte = [1u8];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut control = [0u64; CMSG_ROOM / 8];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    assert!(space <= CMSG_ROOM);
    // SAFETY: an all-zero msghdr is valid; the fields set point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer holds `space` bytes, room for one header
    // and one descriptor, so the first header and its data are inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent != 1 {
        return Err(if sent < 0 { io::Error::last_os_error() } else { io::Error::other("short send") });
    }
    Ok(())
}

/// Receive one descriptor sent by `send_fd`.
fn recv_fd(stream: &UnixStream) -> io::Result<OwnedFd> {
    let mut byte = [0u8];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut control = [0u64; CMSG_ROOM / 8];
    // SAFETY: an all-zero msghdr is valid; the fields set point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM;
    // SAFETY: `msg` points at live buffers for the duration of the call;
    // received descriptors are close-on-exec.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    if got == 0 {
        return Err(io::Error::other("the primary closed the socket without passing its memory"));
    }
    // SAFETY: the kernel filled `msg`'s control buffer; the macros walk it
    // within `msg_controllen`.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() || (*cmsg).cmsg_level != libc::SOL_SOCKET || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            return Err(io::Error::other("no descriptor came with the message"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-over through the real socket: the backup's mapping sees
    /// what the primary writes into its memfd, also after the mapping.
    #[test]
    fn a_passed_memfd_maps_read_only_and_follows_the_writer() {
        let size = 4 * PAGE as u64;
        let offer = Offer::new().unwrap();
        // SAFETY: a fresh memfd with a NUL-terminated name, checked.
        let fd = unsafe { libc::memfd_create(c"pull-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: the descriptor is fresh and owned by nothing else.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(size).unwrap();
        let name = offer.name().to_string();
        let backup = std::thread::spawn(move || PrimaryRam::map(&name, size, Duration::from_secs(5)));
        offer.serve(&memfd, Duration::from_secs(5)).unwrap();
        let ram = backup.join().unwrap().unwrap();
        use std::os::unix::fs::FileExt;
        memfd.write_all_at(&[7u8; PAGE], 2 * PAGE as u64).unwrap();
        let mut page = vec![0u8; PAGE];
        ram.read_page(2, &mut page);
        assert!(page.iter().all(|&b| b == 7));
        ram.read_page(1, &mut page);
        assert!(page.iter().all(|&b| b == 0));
        // Another size than the replica's is refused.
        let offer = Offer::new().unwrap();
        let name = offer.name().to_string();
        let backup = std::thread::spawn(move || PrimaryRam::map(&name, 2 * size, Duration::from_secs(5)).err());
        offer.serve(&memfd, Duration::from_secs(5)).unwrap();
        assert!(matches!(backup.join().unwrap(), Some(PullError::Size { .. })));
    }

    #[test]
    fn pages_of_lists_unconfirmed_at_the_freeze_go_in_the_checkpoint() {
        let mut lists = Lists::default();
        let mut frame = Vec::new();
        let mut pages = PageBitmap::new(64);
        pages.set(3);
        lists.list(&mut frame, 9, &pages);
        pages.clear();
        pages.set(5);
        lists.list(&mut frame, 9, &pages);
        lists.confirmations().store(1, Ordering::Release);
        let mut dirty = PageBitmap::new(64);
        assert_eq!(lists.close(&mut dirty), 1);
        assert_eq!(dirty.pages().collect::<Vec<_>>(), [5]);
        // The next epoch starts with no open lists.
        dirty.clear();
        assert_eq!(lists.close(&mut dirty), 0);
    }
}
