//! One client connection: socket bytes in, `Server::handle`, replies out.
//!
//! Replies are never dropped: what the socket's send buffer cannot take
//! stays in `out`, and the connection is not read again until it has all
//! gone, which also bounds `out` (TCP flow control stops the client).

use alloc::vec::Vec;

use ftvm_kv::{Connection, Flow, Server};
use ftvm_rt::smoltcp::iface::SocketHandle;
use ftvm_rt::smoltcp::socket::tcp::{Socket, State};

use crate::aof::Log;

/// Input fed to the server per call. A pipelined burst can produce far
/// more reply bytes than request bytes (GETs of a big value), and a call
/// runs every complete request it is given, so the input is handed over in
/// slices that hold a bounded number of requests: every request has at
/// least one line feed, so a slice with at most N of them holds at most N
/// requests.
const INPUT_SLICE: usize = 4096;
const SLICE_LINES: usize = 64;
/// Lines per slice after a call that produced more than `OUT_HIGH_WATER`
/// reply bytes, until one produces less.
const SMALL_SLICE_LINES: usize = 4;
/// Stop reading while this many reply bytes wait for the send buffer.
const OUT_HIGH_WATER: usize = 64 * 1024;
/// Reply room made before each slice, so that the usual replies of one
/// call (a pipelined burst of small ones, a value of up to 16 KiB) do not
/// allocate.
const OUT_ROOM: usize = 16 * 1024;

pub struct Client {
    pub handle: SocketHandle,
    conn: Connection,
    out: Vec<u8>,
    /// Bytes of `out` already in the socket.
    sent: usize,
    /// The server asked to close (QUIT, protocol error).
    closing: bool,
    /// The last call produced many reply bytes: feed small slices.
    amplifying: bool,
}

pub struct Ctx<'a> {
    pub server: &'a mut Server,
    pub log: &'a mut Log,
    /// The server's clock in microseconds (see `main`).
    pub now_us: u64,
}

impl Client {
    pub fn new(handle: SocketHandle) -> Client {
        Client { handle, conn: Connection::new(), out: Vec::new(), sent: 0, closing: false, amplifying: false }
    }

    /// Move bytes both ways. Returns (progress, finished): finished means
    /// the socket is closed, or is to be reset, and the handle can be
    /// released.
    pub fn service(&mut self, s: &mut Socket<'static>, cx: &mut Ctx<'_>) -> (bool, bool) {
        let mut progress = self.flush(s);
        while !self.closing && self.pending() < OUT_HIGH_WATER && s.can_recv() {
            self.compact();
            if !self.make_room() {
                // A full heap: give the connection up, buffers and all,
                // rather than fail an allocation. Releasing it while
                // connected resets it, so no reply its client waits for
                // was acknowledged.
                cx.server.count_oom_closed();
                return (true, true);
            }
            let lines = if self.amplifying { SMALL_SLICE_LINES } else { SLICE_LINES };
            let before = self.out.len();
            let mut flow = Flow::Continue;
            let res = s.recv(|input| {
                let n = slice_len(input, INPUT_SLICE, lines);
                flow = cx.server.handle_us(&mut self.conn, &input[..n], cx.now_us, cx.log, &mut self.out);
                (n, ())
            });
            if res.is_err() {
                break;
            }
            progress = true;
            self.amplifying = self.out.len() - before > OUT_HIGH_WATER;
            if flow == Flow::Close {
                self.closing = true;
            }
            self.flush(s);
        }
        // Close our side once every reply is out and either we are done
        // (QUIT) or the client has finished sending.
        let peer_done = !s.may_recv() && !s.can_recv();
        if (self.closing || peer_done) && self.pending() == 0 && s.is_open() && s.may_send() {
            s.close();
            progress = true;
        }
        // Not before CLOSED (or TIME-WAIT): releasing a closing socket aborts
        // it, discarding replies the client has not acknowledged yet.
        let finished = matches!(s.state(), State::Closed | State::TimeWait);
        if finished {
            self.out = Vec::new();
            self.sent = 0;
        }
        (progress, finished)
    }

    /// Drop the replies already sent from the front of `out` (fewer than
    /// `OUT_HIGH_WATER` bytes remain to move), and give back the memory of
    /// a past burst.
    fn compact(&mut self) {
        if self.sent > 0 {
            self.out.drain(..self.sent);
            self.sent = 0;
        }
        if self.out.capacity() > 16 * OUT_HIGH_WATER {
            self.out.shrink_to(OUT_HIGH_WATER);
        }
    }

    /// Whether the buffers have room for one more slice and its replies
    /// (`INPUT_SLICE`, `OUT_ROOM`).
    fn make_room(&mut self) -> bool {
        self.out.try_reserve(OUT_ROOM).is_ok() && self.conn.reserve_input(INPUT_SLICE)
    }

    fn pending(&self) -> usize {
        self.out.len() - self.sent
    }

    /// Send what the socket takes; true if anything went.
    fn flush(&mut self, s: &mut Socket<'static>) -> bool {
        if self.pending() == 0 {
            return false;
        }
        let n = s.send_slice(&self.out[self.sent..]).unwrap_or(0);
        self.sent += n;
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        n > 0
    }
}

/// Length of the longest prefix of `input` of at most `max` bytes that
/// ends at or before its `lines`-th line feed.
fn slice_len(input: &[u8], max: usize, lines: usize) -> usize {
    let window = &input[..input.len().min(max)];
    let mut seen = 0;
    for (i, &b) in window.iter().enumerate() {
        if b == b'\n' {
            seen += 1;
            if seen == lines {
                return i + 1;
            }
        }
    }
    window.len()
}
