//! Command dispatch and what every command shares: arity checks, error
//! wording, and writing log records before mutating.

mod admin;
mod keys;
mod strings;

pub(crate) use strings::apply_set;

use alloc::vec::Vec;

use crate::log::LogSink;
use crate::parse::Args;
use crate::reply;
use crate::server::Server;

/// What the transport should do with a connection after [`Server::handle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Send the replies and keep reading.
    Continue,
    /// Send the replies, then close: the client sent QUIT or broke the
    /// protocol. Later input on this connection is ignored.
    Close,
}

pub(crate) struct Ctx<'a, L> {
    /// The clock in milliseconds (what expiry uses).
    pub now: u64,
    /// The same clock in microseconds (what TIME reports).
    pub now_us: u64,
    pub log: &'a mut L,
    pub out: &'a mut Vec<u8>,
}

/// Every command with its Redis arity: n means exactly n words including
/// the name, -n means at least n.
pub(crate) const COMMANDS: &[(&str, i32)] = &[
    ("append", 3),
    ("client", -2),
    ("command", -1),
    ("config", -2),
    ("dbsize", 1),
    ("decr", 2),
    ("decrby", 3),
    ("del", -2),
    ("echo", 2),
    ("exists", -2),
    ("flushall", -1),
    ("flushdb", -1),
    ("get", 2),
    ("incr", 2),
    ("incrby", 3),
    ("info", -1),
    ("keys", 2),
    ("mget", -2),
    ("mset", -3),
    ("ping", -1),
    ("pttl", 2),
    ("quit", -1),
    ("select", 2),
    ("set", -3),
    ("strlen", 2),
    ("time", 1),
    ("ttl", 2),
];

/// Redis's prefix for a write refused for memory (`maxmemory`), which
/// clients know; here the limit is the guest's memory itself.
pub(crate) const OOM: &str = "OOM command not allowed when used memory > 'maxmemory' (the guest's memory is full; the key was not stored)";

/// Bytes a key costs beyond its name and value (see `execute`).
const KEY_OVERHEAD: usize = 96;

/// Commands that may add keys: how many at most, given `words` words.
fn new_keys(cmd: &str, words: usize) -> Option<usize> {
    match cmd {
        "set" | "incr" | "decr" | "incrby" | "decrby" | "append" => Some(1),
        "mset" => Some(words / 2),
        _ => None,
    }
}

pub(crate) const NOT_INTEGER: &str = "ERR value is not an integer or out of range";
pub(crate) const SYNTAX: &str = "ERR syntax error";

pub(crate) fn execute<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) -> Flow {
    srv.stats.commands += 1;
    let name = a.get(0);
    let mut lower = [0u8; 16];
    let Some(idx) = lookup(name, &mut lower) else {
        unknown_command(name, a, cx.out);
        return Flow::Continue;
    };
    let (cmd, arity) = COMMANDS[idx];
    let n = a.len() as i64;
    if (arity >= 0 && n != i64::from(arity)) || (arity < 0 && n < -i64::from(arity)) {
        wrong_arity(cx.out, cmd);
        return Flow::Continue;
    }
    if let Some(keys) = new_keys(cmd, a.len()) {
        // The words are what the store copies; each key also costs its
        // table slot and two allocations' headers, and a counter its digits.
        let bytes: usize = a.iter().skip(1).map(<[u8]>::len).sum::<usize>() + keys * KEY_OVERHEAD;
        let free = srv.free_memory.is_none_or(|free| free() >= bytes.saturating_add(crate::server::MEMORY_RESERVE));
        if !free || !srv.db.room_for(keys, bytes) {
            srv.stats.oom_refused += 1;
            reply::err(cx.out, OOM);
            return Flow::Continue;
        }
    }
    match cmd {
        "get" => strings::get(srv, a, cx),
        "set" => strings::set(srv, a, cx),
        "incr" => strings::incr_by(srv, a.get(1), 1, cx),
        "decr" => strings::incr_by(srv, a.get(1), -1, cx),
        "incrby" => strings::incrby(srv, a, false, cx),
        "decrby" => strings::incrby(srv, a, true, cx),
        "append" => strings::append(srv, a, cx),
        "strlen" => strings::strlen(srv, a, cx),
        "mset" => strings::mset(srv, a, cx),
        "mget" => strings::mget(srv, a, cx),
        "del" => keys::del(srv, a, cx),
        "exists" => keys::exists(srv, a, cx),
        "ttl" => keys::ttl(srv, a, false, cx),
        "pttl" => keys::ttl(srv, a, true, cx),
        "keys" => keys::keys(srv, a, cx),
        "dbsize" => keys::dbsize(srv, cx),
        "flushall" | "flushdb" => keys::flush(srv, a, cx),
        "ping" => admin::ping(a, cx),
        "echo" => reply::bulk(cx.out, a.get(1)),
        "select" => admin::select(a, cx),
        "info" => admin::info(srv, a, cx),
        "config" => admin::config(srv, a, cx),
        "command" => admin::command(a, cx),
        "client" => admin::client(a, cx),
        "time" => admin::time(cx),
        "quit" => {
            reply::ok(cx.out);
            return Flow::Close;
        }
        _ => unreachable!("every COMMANDS entry is dispatched"),
    }
    Flow::Continue
}

/// Index into COMMANDS of the case-insensitive `name`.
fn lookup(name: &[u8], lower: &mut [u8; 16]) -> Option<usize> {
    if name.len() > lower.len() {
        return None;
    }
    let lower = &mut lower[..name.len()];
    for (l, c) in lower.iter_mut().zip(name) {
        *l = c.to_ascii_lowercase();
    }
    COMMANDS.binary_search_by(|(c, _)| c.as_bytes().cmp(lower)).ok()
}

pub(crate) fn eq_ignore_case(a: &[u8], b: &str) -> bool {
    a.eq_ignore_ascii_case(b.as_bytes())
}

pub(crate) fn wrong_arity(out: &mut Vec<u8>, cmd: &str) {
    reply::error(out, &[b"ERR wrong number of arguments for '", cmd.as_bytes(), b"' command"]);
}

/// Redis 7's wording, including the quoting of up to 128 bytes of
/// arguments and the trailing space.
fn unknown_command(name: &[u8], a: Args<'_>, out: &mut Vec<u8>) {
    let mut msg = Vec::with_capacity(64);
    msg.extend_from_slice(b"ERR unknown command '");
    msg.extend_from_slice(&name[..name.len().min(128)]);
    msg.extend_from_slice(b"', with args beginning with: ");
    let mut shown = 0;
    for arg in a.iter().skip(1) {
        if shown >= 128 {
            break;
        }
        let take = arg.len().min(128 - shown);
        msg.push(b'\'');
        msg.extend_from_slice(&arg[..take]);
        msg.extend_from_slice(b"' ");
        shown += take + 3;
    }
    reply::error(out, &[&msg]);
}

pub(crate) fn unknown_subcommand(out: &mut Vec<u8>, sub: &[u8], cmd: &str) {
    reply::error(out, &[b"ERR unknown subcommand '", &sub[..sub.len().min(128)], b"'. Try ", cmd.as_bytes(), b" HELP."]);
}

/// Hand the record built by `build` to the log; on failure reply with the
/// error and return false, and the caller must then leave the store alone.
pub(crate) fn logged<L: LogSink>(record: &mut Vec<u8>, cx: &mut Ctx<'_, L>, build: impl FnOnce(&mut Vec<u8>)) -> bool {
    if !cx.log.enabled() {
        return true;
    }
    record.clear();
    build(record);
    let res = cx.log.append(record);
    if record.capacity() > 1 << 20 {
        *record = Vec::new();
    }
    match res {
        Ok(()) => true,
        Err(e) => {
            reply::error(cx.out, &[b"ERR ", e.as_str().as_bytes(), b": append-only log write failed, command not applied"]);
            false
        }
    }
}

/// Start a record of `n` words.
pub(crate) fn rec_start(rec: &mut Vec<u8>, n: usize) {
    reply::array_len(rec, n);
}

pub(crate) fn rec_word(rec: &mut Vec<u8>, word: &[u8]) {
    reply::bulk(rec, word);
}
