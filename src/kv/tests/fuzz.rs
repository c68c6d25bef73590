//! Deterministic fuzzing: random and mutated request streams must never
//! panic, must keep every reply well-formed RESP, and must keep a
//! connection's buffered input bounded.

mod common;
use common::{resp, MemLog};
use ftvm_kv::{Connection, Flow, LogError, Server, MAX_INLINE_LEN, MAX_REQUEST_LEN};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

const WORDS: &[&str] = &[
    "SET",
    "GET",
    "DEL",
    "EXISTS",
    "INCR",
    "DECR",
    "INCRBY",
    "DECRBY",
    "APPEND",
    "STRLEN",
    "MSET",
    "MGET",
    "DBSIZE",
    "FLUSHALL",
    "FLUSHDB",
    "INFO",
    "CONFIG",
    "COMMAND",
    "CLIENT",
    "PING",
    "ECHO",
    "SELECT",
    "TTL",
    "PTTL",
    "KEYS",
    "EX",
    "PX",
    "EXAT",
    "PXAT",
    "NX",
    "XX",
    "GET",
    "KEEPTTL",
    "k",
    "k2",
    "*",
    "?",
    "[a-",
    "\\",
    "0",
    "1",
    "-1",
    "9223372036854775807",
    "-9223372036854775808",
    "99999999999999999999",
    "10",
    "abc",
    "",
    "save",
    "appendonly",
    "DOCS",
    "SETNAME",
    "keyspace",
    "server",
    "QUIT",
];

/// A valid request, RESP or inline.
fn request(rng: &mut Rng) -> Vec<u8> {
    let n = 1 + rng.below(5);
    let args: Vec<&[u8]> = (0..n).map(|_| rng.pick(WORDS).as_bytes()).collect();
    if rng.below(4) == 0 {
        let mut line = args.join(&b' ');
        line.extend_from_slice(if rng.below(2) == 0 { b"\r\n" } else { b"\n" });
        line
    } else {
        resp(&args)
    }
}

fn mutate(rng: &mut Rng, v: &mut Vec<u8>) {
    const BYTES: &[u8] = b"*$\r\n-0123456789 \"'\\x:+";
    for _ in 0..rng.below(4) {
        let at = if v.is_empty() { 0 } else { rng.below(v.len() + 1) };
        match rng.below(7) {
            0 if at < v.len() => v[at] = rng.next() as u8,
            1 if at < v.len() => v[at] = *rng.pick(BYTES),
            2 => v.insert(at, *rng.pick(BYTES)),
            3 if at < v.len() => {
                v.remove(at);
            }
            4 => v.truncate(at),
            5 if at < v.len() => {
                let end = (at + rng.below(16)).min(v.len());
                let dup = v[at..end].to_vec();
                v.splice(at..at, dup);
            }
            6 => {
                let digits = format!("{}", rng.next() as i64 >> rng.below(64));
                v.splice(at..at, digits.bytes());
            }
            _ => {}
        }
    }
}

/// Check `out` is a sequence of complete RESP2 replies.
fn well_formed(mut out: &[u8]) -> Result<(), String> {
    fn line(b: &[u8]) -> Result<(&[u8], &[u8]), String> {
        let i = b.windows(2).position(|w| w == b"\r\n").ok_or("no CRLF")?;
        let l = &b[1..i];
        if l.contains(&b'\r') || l.contains(&b'\n') {
            return Err("CR or LF inside a line".into());
        }
        Ok((l, &b[i + 2..]))
    }
    fn one(b: &[u8]) -> Result<&[u8], String> {
        let (l, rest) = line(b)?;
        let num = || std::str::from_utf8(l).ok().and_then(|s| s.parse::<i64>().ok()).ok_or("bad number");
        match b[0] {
            b'+' | b'-' => Ok(rest),
            b':' => num().map(|_| rest).map_err(Into::into),
            b'$' => match num()? {
                -1 => Ok(rest),
                n if n >= 0 && rest.len() >= n as usize + 2 && &rest[n as usize..n as usize + 2] == b"\r\n" => Ok(&rest[n as usize + 2..]),
                _ => Err("bad bulk".into()),
            },
            b'*' => {
                let mut rest = rest;
                for _ in 0..num()? {
                    rest = one(rest)?;
                }
                Ok(rest)
            }
            c => Err(format!("bad type byte {c:?}")),
        }
    }
    while !out.is_empty() {
        out = one(out)?;
    }
    Ok(())
}

#[test]
fn fuzz_handle_never_panics() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut srv = Server::new();
    let mut conn = Connection::new();
    let mut log = MemLog::default();
    let mut now = 1_000u64;
    let mut out = Vec::new();
    let mut closes = 0;
    let mut stuck = 0;
    for iter in 0..300_000 {
        let mut input = Vec::new();
        match rng.below(4) {
            // Pure noise, biased towards protocol bytes.
            0 => {
                for _ in 0..rng.below(48) {
                    let b = if rng.below(2) == 0 { *rng.pick(b"*$\r\n-0123456789 ") } else { rng.next() as u8 };
                    input.push(b);
                }
            }
            // Valid requests, mutated.
            _ => {
                for _ in 0..1 + rng.below(3) {
                    input.extend(request(&mut rng));
                }
                mutate(&mut rng, &mut input);
            }
        }
        now += rng.below(50) as u64;
        log.fail = match rng.below(20) {
            0 => Some(LogError::Full),
            1 => Some(LogError::Io),
            _ => None,
        };
        out.clear();
        // Feed in random pieces, as a network would deliver them.
        let mut rest = &input[..];
        let mut flow = Flow::Continue;
        while !rest.is_empty() && flow == Flow::Continue {
            let n = 1 + rng.below(rest.len());
            flow = srv.handle(&mut conn, &rest[..n], now, &mut log, &mut out);
            rest = &rest[n..];
            assert!(conn.buffered_len() <= MAX_REQUEST_LEN, "iteration {iter}: {}", conn.buffered_len());
        }
        if let Err(e) = well_formed(&out) {
            panic!("iteration {iter}: {e}: {:?} -> {:?}", String::from_utf8_lossy(&input), String::from_utf8_lossy(&out));
        }
        if flow == Flow::Close {
            closes += 1;
            conn = Connection::new();
        } else if conn.buffered_len() > MAX_INLINE_LEN {
            // Legitimately waiting for a long bulk that noise keeps feeding;
            // start over so the rest of the run tests parsing.
            stuck += 1;
            conn = Connection::new();
        }
        if log.records.len() > 10_000 {
            log.records.clear();
        }
        if srv.dbsize() > 10_000 {
            srv.handle(&mut conn, b"FLUSHALL\r\n", now, &mut ftvm_kv::NoLog, &mut out);
        }
    }
    // The mix exercises both outcomes.
    assert!(closes > 1000 && stuck < closes, "{closes} {stuck}");
}

#[test]
fn fuzz_replay_never_panics() {
    let mut rng = Rng(42);
    let mut srv = Server::new();
    let mut ok = 0;
    for _ in 0..100_000 {
        let mut rec = request(&mut rng);
        if rng.below(3) != 0 {
            mutate(&mut rng, &mut rec);
        }
        ok += usize::from(srv.replay(&rec, rng.below(1 << 20) as u64).is_ok());
        if srv.dbsize() > 10_000 {
            srv.replay(&resp(&[b"FLUSHALL"]), 0).unwrap();
        }
    }
    assert!(ok > 1000, "{ok}");
}

#[test]
fn fuzz_aof_records_never_panic() {
    let mut rng = Rng(7);
    for _ in 0..20_000 {
        let mut dev = Vec::new();
        for _ in 0..rng.below(5) {
            ftvm_kv::aof::encode(&request(&mut rng), &mut dev);
        }
        mutate(&mut rng, &mut dev);
        let mut last = 0;
        for (payload, end) in ftvm_kv::aof::records(&dev) {
            assert!(end > last && end <= dev.len() && !payload.is_empty());
            last = end;
        }
    }
}
