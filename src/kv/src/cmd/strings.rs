//! String commands: GET, SET, INCR/DECR family, APPEND, STRLEN, MSET, MGET.
//!
//! Each mutating command logs a record that reproduces its effect without
//! looking at the clock or at state that may have expired by replay time:
//! INCR logs the resulting SET with the key's absolute expiry, SET logs
//! PXAT instead of EX/PX/KEEPTTL, and conditions (NX/XX) are decided here
//! and never logged.

use crate::cmd::{logged, rec_start, rec_word, Ctx, NOT_INTEGER, SYNTAX};
use crate::log::LogSink;
use crate::num::{parse_i64, Digits};
use crate::parse::Args;
use crate::reply;
use crate::server::Server;
use crate::store::{Db, NEVER};

/// Redis's proto-max-bulk-len: APPEND may not grow a value past it.
const MAX_VALUE_LEN: usize = 512 << 20;

/// Reply with `key`'s value (or nil), counting the hit or miss.
fn reply_value(srv: &mut Server, key: &[u8], now: u64, out: &mut alloc::vec::Vec<u8>) {
    match srv.db.get_live(key, now) {
        Some(e) => {
            srv.stats.hits += 1;
            reply::bulk(out, &e.value);
        }
        None => {
            srv.stats.misses += 1;
            reply::nil(out);
        }
    }
}

pub fn get<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    reply_value(srv, a.get(1), cx.now, cx.out);
}

#[derive(Clone, Copy, PartialEq)]
enum Cond {
    Always,
    IfAbsent,
    IfPresent,
}

#[derive(Clone, Copy, PartialEq)]
enum Ttl {
    /// No option: the key loses any expiry.
    Clear,
    Keep,
    At(u64),
}

struct SetOptions {
    cond: Cond,
    ttl: Ttl,
    get: bool,
}

/// Parse SET's options after key and value. Errors are the reply text.
fn set_options(a: Args<'_>, now: u64) -> Result<SetOptions, &'static str> {
    let mut o = SetOptions { cond: Cond::Always, ttl: Ttl::Clear, get: false };
    // Relative units are resolved after the loop so that every syntax
    // error is reported before any number error, as Redis does.
    let mut expire: Option<(&[u8], u64, bool)> = None;
    let mut i = 3;
    while i < a.len() {
        let opt = a.get(i);
        let upper = |s: &str| opt.eq_ignore_ascii_case(s.as_bytes());
        if upper("NX") && o.cond != Cond::IfPresent {
            o.cond = Cond::IfAbsent;
        } else if upper("XX") && o.cond != Cond::IfAbsent {
            o.cond = Cond::IfPresent;
        } else if upper("GET") {
            o.get = true;
        } else if upper("KEEPTTL") && expire.is_none() {
            o.ttl = Ttl::Keep;
        } else if (upper("EX") || upper("PX") || upper("EXAT") || upper("PXAT")) && o.ttl != Ttl::Keep && i + 1 < a.len() {
            let unit = if opt[0].eq_ignore_ascii_case(&b'e') { 1000 } else { 1 };
            let absolute = opt.len() == 4;
            // Repeating the same option is allowed (the last one counts);
            // mixing two is not.
            if expire.is_some_and(|(_, u, abs)| (u, abs) != (unit, absolute)) {
                return Err(SYNTAX);
            }
            i += 1;
            expire = Some((a.get(i), unit, absolute));
        } else {
            return Err(SYNTAX);
        }
        i += 1;
    }
    if let Some((num, unit, absolute)) = expire {
        let n = parse_i64(num).ok_or(NOT_INTEGER)?;
        const INVALID: &str = "ERR invalid expire time in 'set' command";
        if n <= 0 {
            return Err(INVALID);
        }
        let ms = (n as u64).checked_mul(unit).ok_or(INVALID)?;
        let at = if absolute { Some(ms) } else { ms.checked_add(now) };
        match at {
            Some(at) if at <= i64::MAX as u64 => o.ttl = Ttl::At(at),
            _ => return Err(INVALID),
        }
    }
    Ok(o)
}

pub fn set<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let (key, value) = (a.get(1), a.get(2));
    let opts = match set_options(a, cx.now) {
        Ok(o) => o,
        Err(msg) => return reply::err(cx.out, msg),
    };
    let old_expiry = srv.db.get_live(key, cx.now).map(|e| e.expire_at);
    let met = match opts.cond {
        Cond::Always => true,
        Cond::IfAbsent => old_expiry.is_none(),
        Cond::IfPresent => old_expiry.is_some(),
    };
    if !met {
        return reply_old(&srv.db, key, opts.get, cx);
    }
    let at = match opts.ttl {
        Ttl::Clear => NEVER,
        Ttl::Keep => old_expiry.unwrap_or(NEVER),
        Ttl::At(at) => at,
    };
    if !logged(&mut srv.record, cx, |r| record_set(r, key, value, at)) {
        return;
    }
    if opts.get {
        reply_old(&srv.db, key, true, cx);
    } else {
        reply::ok(cx.out);
    }
    apply_set(&mut srv.db, key, value, at, cx.now);
}

/// SET ... GET's reply (the previous value), or SET's nil for an unmet
/// condition.
fn reply_old<L>(db: &Db, key: &[u8], get: bool, cx: &mut Ctx<'_, L>) {
    match db.peek_live(key, cx.now) {
        Some(e) if get => reply::bulk(cx.out, &e.value),
        _ => reply::nil(cx.out),
    }
}

/// `SET key value` or `SET key value PXAT at`.
pub(crate) fn record_set(r: &mut alloc::vec::Vec<u8>, key: &[u8], value: &[u8], at: u64) {
    rec_start(r, if at == NEVER { 3 } else { 5 });
    rec_word(r, b"SET");
    rec_word(r, key);
    rec_word(r, value);
    if at != NEVER {
        rec_word(r, b"PXAT");
        rec_word(r, Digits::u64(at).as_bytes());
    }
}

/// Store, or drop the key if its expiry time has already passed (an
/// EXAT/PXAT in the past, or a record replayed after its key expired).
pub(crate) fn apply_set(db: &mut Db, key: &[u8], value: &[u8], at: u64, now: u64) {
    if at <= now {
        db.remove(key);
    } else {
        db.set(key, value, at);
    }
}

pub fn incrby<L: LogSink>(srv: &mut Server, a: Args<'_>, negate: bool, cx: &mut Ctx<'_, L>) {
    let Some(n) = parse_i64(a.get(2)) else {
        return reply::err(cx.out, NOT_INTEGER);
    };
    let delta = if negate {
        match n.checked_neg() {
            Some(d) => d,
            None => return reply::err(cx.out, "ERR decrement would overflow"),
        }
    } else {
        n
    };
    incr_by(srv, a.get(1), delta, cx);
}

pub fn incr_by<L: LogSink>(srv: &mut Server, key: &[u8], delta: i64, cx: &mut Ctx<'_, L>) {
    let (old, at) = match srv.db.get_live(key, cx.now) {
        None => (0, NEVER),
        Some(e) => match parse_i64(&e.value) {
            Some(v) => (v, e.expire_at),
            None => return reply::err(cx.out, NOT_INTEGER),
        },
    };
    let Some(new) = old.checked_add(delta) else {
        return reply::err(cx.out, "ERR increment or decrement would overflow");
    };
    let digits = Digits::i64(new);
    if !logged(&mut srv.record, cx, |r| record_set(r, key, digits.as_bytes(), at)) {
        return;
    }
    srv.db.set(key, digits.as_bytes(), at);
    reply::int(cx.out, new);
}

pub fn append<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let (key, suffix) = (a.get(1), a.get(2));
    let old_len = srv.db.get_live(key, cx.now).map(|e| e.value.len());
    let new_len = old_len.unwrap_or(0) + suffix.len();
    if new_len > MAX_VALUE_LEN {
        return reply::err(cx.out, "ERR string exceeds maximum allowed size (proto-max-bulk-len)");
    }
    // Appending to nothing is a SET; logging it as one keeps replay from
    // appending to a stale value that had expired here.
    let ok = logged(&mut srv.record, cx, |r| {
        if old_len.is_some() {
            rec_start(r, 3);
            rec_word(r, b"APPEND");
            rec_word(r, key);
            rec_word(r, suffix);
        } else {
            record_set(r, key, suffix, NEVER);
        }
    });
    if !ok {
        return;
    }
    if old_len.is_some() {
        srv.db.raw_append(key, suffix);
    } else {
        srv.db.set(key, suffix, NEVER);
    }
    reply::int(cx.out, new_len as i64);
}

pub fn strlen<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let len = srv.db.get_live(a.get(1), cx.now).map_or(0, |e| e.value.len());
    reply::int(cx.out, len as i64);
}

pub fn mset<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    if a.len().is_multiple_of(2) {
        return crate::cmd::wrong_arity(cx.out, "mset");
    }
    let ok = logged(&mut srv.record, cx, |r| {
        rec_start(r, a.len());
        rec_word(r, b"MSET");
        for word in a.iter().skip(1) {
            rec_word(r, word);
        }
    });
    if !ok {
        return;
    }
    for i in (1..a.len()).step_by(2) {
        srv.db.set(a.get(i), a.get(i + 1), NEVER);
    }
    reply::ok(cx.out);
}

pub fn mget<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    reply::array_len(cx.out, a.len() - 1);
    for key in a.iter().skip(1) {
        reply_value(srv, key, cx.now, cx.out);
    }
}
