//! One client connection and the request loop that runs its bytes through
//! the server.

use alloc::vec::Vec;

use crate::cmd::{self, Ctx, Flow};
use crate::log::LogSink;
use crate::parse::{Parser, Step};
use crate::server::{clamp, Server};

/// One client's state: the unparsed tail of its input and the closing flag.
/// (Only database 0 exists, so there is no selected-database state.)
#[derive(Default)]
pub struct Connection {
    /// Bytes of a request not yet complete; always starts at a request
    /// boundary, so it is empty between whole requests.
    pending: Vec<u8>,
    parser: Parser,
    closing: bool,
}

impl Connection {
    pub fn new() -> Connection {
        Connection::default()
    }

    /// Bytes buffered for an incomplete request. Bounded by
    /// [`crate::MAX_REQUEST_LEN`] plus the size of the last input.
    pub fn buffered_len(&self) -> usize {
        self.pending.len()
    }

    /// Make room for `n` more input bytes without allocating in `handle`,
    /// which keeps at most that many of an input of `n` bytes. False when
    /// the heap cannot give it: the caller should not feed this connection
    /// (a full guest sheds it rather than fail an allocation, which ends
    /// the guest).
    pub fn reserve_input(&mut self, n: usize) -> bool {
        self.pending.try_reserve(n).is_ok()
    }

    /// Whether the connection has seen QUIT or a protocol error.
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    fn close(&mut self) {
        self.closing = true;
        self.pending = Vec::new();
        self.parser.reset();
    }
}

impl Server {
    /// Feed bytes that arrived on `conn`: run every complete request in
    /// order, appending replies to `out`, and keep an incomplete tail for
    /// the next call. Each mutating command is first passed to `log` as a
    /// record and only applied if that succeeds.
    pub fn handle(&mut self, conn: &mut Connection, input: &[u8], now_ms: u64, log: &mut impl LogSink, out: &mut Vec<u8>) -> Flow {
        self.handle_us(conn, input, now_ms.saturating_mul(1000), log, out)
    }

    /// [`Server::handle`] with the clock in microseconds: expiry still
    /// works in milliseconds (`now_us / 1000`), and TIME replies with
    /// `now_us` split into seconds and microseconds.
    pub fn handle_us(&mut self, conn: &mut Connection, input: &[u8], now_us: u64, log: &mut impl LogSink, out: &mut Vec<u8>) -> Flow {
        if conn.closing {
            return Flow::Close;
        }
        let now_ms = now_us / 1000;
        self.expire(now_ms);
        let mut cx = Ctx { now: clamp(now_ms), now_us, log, out };
        let flow = if conn.pending.is_empty() {
            // The usual case: parse in place and copy only an unfinished tail.
            let (used, flow) = self.run(&mut conn.parser, input, &mut cx);
            if flow == Flow::Continue {
                conn.pending.extend_from_slice(&input[used..]);
            }
            flow
        } else {
            conn.pending.extend_from_slice(input);
            let (used, flow) = self.run(&mut conn.parser, &conn.pending, &mut cx);
            if used == conn.pending.len() {
                conn.pending.clear();
                if conn.pending.capacity() > 1 << 20 {
                    // A big request has gone through; don't keep its buffer.
                    conn.pending = Vec::new();
                }
            } else if used > 0 {
                // The remainder is one unfinished request, moved to the
                // front once: while it stays unfinished `used` is 0.
                conn.pending.drain(..used);
            }
            flow
        };
        if flow == Flow::Close {
            conn.close();
        }
        flow
    }

    /// Run the complete requests at the start of `data`; returns the bytes
    /// consumed.
    fn run<L: LogSink>(&mut self, parser: &mut Parser, data: &[u8], cx: &mut Ctx<'_, L>) -> (usize, Flow) {
        let mut off = 0;
        while off < data.len() {
            let request = &data[off..];
            match parser.next(request) {
                Step::Incomplete => break,
                Step::Skip(n) => {
                    parser.reset();
                    off += n;
                }
                Step::Command(n) => {
                    let flow = cmd::execute(self, parser.args(request), cx);
                    parser.reset();
                    off += n;
                    if flow == Flow::Close {
                        return (off, flow);
                    }
                }
                Step::Error(e) => {
                    cx.out.extend_from_slice(b"-ERR Protocol error: ");
                    e.write(cx.out);
                    cx.out.extend_from_slice(b"\r\n");
                    return (off, Flow::Close);
                }
            }
        }
        (off, Flow::Continue)
    }
}
