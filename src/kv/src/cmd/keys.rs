//! Keyspace commands: DEL, EXISTS, TTL/PTTL, KEYS, DBSIZE, FLUSHALL/FLUSHDB.

use alloc::vec::Vec;

use crate::cmd::{eq_ignore_case, logged, rec_start, rec_word, Ctx, SYNTAX};
use crate::glob;
use crate::log::LogSink;
use crate::parse::Args;
use crate::reply;
use crate::server::Server;
use crate::store::NEVER;

pub fn del<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let now = cx.now;
    let live = a.iter().skip(1).filter(|k| srv.db.peek_live(k, now).is_some()).count();
    if live == 0 {
        return reply::int(cx.out, 0);
    }
    // Only the keys that exist: replay then never depends on whether a key
    // had expired. A key named twice is logged twice, which is harmless.
    let db = &srv.db;
    let ok = logged(&mut srv.record, cx, |r| {
        rec_start(r, live + 1);
        rec_word(r, b"DEL");
        for k in a.iter().skip(1).filter(|k| db.peek_live(k, now).is_some()) {
            rec_word(r, k);
        }
    });
    if !ok {
        return;
    }
    let removed = a.iter().skip(1).filter(|k| srv.db.remove_live(k, now)).count();
    reply::int(cx.out, removed as i64);
}

pub fn exists<L>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let n = a.iter().skip(1).filter(|k| srv.db.peek_live(k, cx.now).is_some()).count();
    reply::int(cx.out, n as i64);
}

pub fn ttl<L>(srv: &mut Server, a: Args<'_>, millis: bool, cx: &mut Ctx<'_, L>) {
    let n = match srv.db.get_live(a.get(1), cx.now) {
        None => -2,
        Some(e) if e.expire_at == NEVER => -1,
        Some(e) => {
            let left = (e.expire_at - cx.now) as i64;
            if millis {
                left
            } else {
                (left + 500) / 1000
            }
        }
    };
    reply::int(cx.out, n);
}

pub fn keys<L>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let pat = a.get(1);
    let all = pat == b"*";
    let hits: Vec<&[u8]> = srv.db.iter().filter(|(k, e)| e.live(cx.now) && (all || glob::matches(pat, k))).map(|(k, _)| k).collect();
    reply::array_len(cx.out, hits.len());
    for k in hits {
        reply::bulk(cx.out, k);
    }
}

pub fn dbsize<L>(srv: &mut Server, cx: &mut Ctx<'_, L>) {
    // Keys set earlier in this same input with a time already past would
    // otherwise still count.
    srv.expire(cx.now);
    reply::int(cx.out, srv.db.len() as i64);
}

pub fn flush<L: LogSink>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    match a.len() {
        1 => {}
        2 if eq_ignore_case(a.get(1), "sync") || eq_ignore_case(a.get(1), "async") => {}
        _ => return reply::err(cx.out, SYNTAX),
    }
    let ok = logged(&mut srv.record, cx, |r| {
        rec_start(r, 1);
        rec_word(r, b"FLUSHALL");
    });
    if ok {
        srv.db.clear();
        reply::ok(cx.out);
    }
}
