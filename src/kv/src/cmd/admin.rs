//! Connection and server commands: PING, SELECT, INFO, CONFIG, COMMAND,
//! CLIENT, TIME. Enough for redis-cli and redis-benchmark to start and report.

use alloc::vec::Vec;

use crate::cmd::{eq_ignore_case, unknown_subcommand, wrong_arity, Ctx, COMMANDS, NOT_INTEGER};
use crate::glob;
use crate::num::{parse_i64, push_u64};
use crate::parse::Args;
use crate::reply;
use crate::server::Server;

pub fn ping<L>(a: Args<'_>, cx: &mut Ctx<'_, L>) {
    match a.len() {
        1 => reply::simple(cx.out, b"PONG"),
        2 => reply::bulk(cx.out, a.get(1)),
        _ => wrong_arity(cx.out, "ping"),
    }
}

pub fn select<L>(a: Args<'_>, cx: &mut Ctx<'_, L>) {
    match parse_i64(a.get(1)) {
        None => reply::err(cx.out, NOT_INTEGER),
        Some(0) => reply::ok(cx.out),
        Some(_) => reply::err(cx.out, "ERR DB index is out of range"),
    }
}

const SECTIONS: &[&str] = &["server", "persistence", "stats", "keyspace"];

pub fn info<L>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    srv.expire(cx.now);
    let everything = a.len() == 1 || a.iter().skip(1).any(|s| ["all", "default", "everything"].iter().any(|w| eq_ignore_case(s, w)));
    let mut text = Vec::with_capacity(512);
    for &section in SECTIONS {
        if !everything && !a.iter().skip(1).any(|s| eq_ignore_case(s, section)) {
            continue;
        }
        if !text.is_empty() {
            text.extend_from_slice(b"\r\n");
        }
        let line = |text: &mut Vec<u8>, name: &str, v: u64| {
            text.extend_from_slice(name.as_bytes());
            text.push(b':');
            push_u64(text, v);
            text.extend_from_slice(b"\r\n");
        };
        match section {
            "server" => {
                text.extend_from_slice(b"# Server\r\nredis_version:7.0.0\r\nredis_mode:standalone\r\nos:ftvm\r\narch_bits:64\r\n");
                let up = cx.now.saturating_sub(srv.started_ms.unwrap_or(cx.now));
                line(&mut text, "uptime_in_seconds", up / 1000);
            }
            "persistence" => {
                text.extend_from_slice(b"# Persistence\r\nloading:0\r\n");
                line(&mut text, "aof_enabled", u64::from(srv.appendonly));
            }
            "stats" => {
                text.extend_from_slice(b"# Stats\r\n");
                line(&mut text, "total_commands_processed", srv.stats.commands);
                line(&mut text, "expired_keys", srv.stats.expired);
                line(&mut text, "keyspace_hits", srv.stats.hits);
                line(&mut text, "keyspace_misses", srv.stats.misses);
                line(&mut text, "oom_refused_writes", srv.stats.oom_refused);
                line(&mut text, "oom_closed_connections", srv.stats.oom_closed);
            }
            _ => {
                text.extend_from_slice(b"# Keyspace\r\ndb0:keys=");
                push_u64(&mut text, srv.db.len() as u64);
                text.extend_from_slice(b",expires=");
                push_u64(&mut text, srv.db.volatile() as u64);
                text.extend_from_slice(b",avg_ttl=0\r\n");
            }
        }
    }
    reply::bulk(cx.out, &text);
}

pub fn config<L>(srv: &mut Server, a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let sub = a.get(1);
    if !eq_ignore_case(sub, "get") {
        return unknown_subcommand(cx.out, sub, "CONFIG");
    }
    if a.len() < 3 {
        return wrong_arity(cx.out, "config|get");
    }
    let params: [(&str, &[u8]); 3] = [("save", b""), ("appendonly", if srv.appendonly { b"yes" } else { b"no" }), ("databases", b"1")];
    let hits: Vec<&(&str, &[u8])> =
        params.iter().filter(|(name, _)| a.iter().skip(2).any(|pat| glob::matches(&pat.to_ascii_lowercase(), name.as_bytes()))).collect();
    reply::array_len(cx.out, hits.len() * 2);
    for (name, value) in hits {
        reply::bulk(cx.out, name.as_bytes());
        reply::bulk(cx.out, value);
    }
}

/// redis-cli asks for COMMAND DOCS at start and copes with an empty
/// answer; nothing else here needs the full command table.
pub fn command<L>(a: Args<'_>, cx: &mut Ctx<'_, L>) {
    if a.len() == 1 {
        return reply::array_len(cx.out, 0);
    }
    let sub = a.get(1);
    if eq_ignore_case(sub, "count") {
        reply::int(cx.out, COMMANDS.len() as i64);
    } else if ["docs", "info", "list"].iter().any(|s| eq_ignore_case(sub, s)) {
        reply::array_len(cx.out, 0);
    } else {
        unknown_subcommand(cx.out, sub, "COMMAND");
    }
}

pub fn client<L>(a: Args<'_>, cx: &mut Ctx<'_, L>) {
    let sub = a.get(1);
    let (name, arity) = if eq_ignore_case(sub, "setname") {
        ("client|setname", 3)
    } else if eq_ignore_case(sub, "setinfo") {
        ("client|setinfo", 4)
    } else if eq_ignore_case(sub, "getname") {
        ("client|getname", 2)
    } else {
        return unknown_subcommand(cx.out, sub, "CLIENT");
    };
    if a.len() != arity {
        return wrong_arity(cx.out, name);
    }
    if arity == 2 {
        reply::nil(cx.out);
    } else {
        reply::ok(cx.out);
    }
}

/// TIME: the server's clock as `[seconds, microseconds]`, like Redis. The
/// guest has no wall clock, so this is whatever clock the transport passes
/// to [`Server::handle_us`] (the kv guest: guest time since boot, plus its
/// `epoch_ms=` offset).
pub fn time<L>(cx: &mut Ctx<'_, L>) {
    let mut n = Vec::with_capacity(20);
    reply::array_len(cx.out, 2);
    push_u64(&mut n, cx.now_us / 1_000_000);
    reply::bulk(cx.out, &n);
    n.clear();
    push_u64(&mut n, cx.now_us % 1_000_000);
    reply::bulk(cx.out, &n);
}
