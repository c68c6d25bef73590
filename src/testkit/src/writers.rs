//! Acknowledged-write tracking: client connections that SET unique keys
//! (key `PREFIX:CONN:I`, value derived from the key) and remember each key
//! whose `+OK` arrived, then a reader that checks every remembered key.
//! A write whose reply did not arrive (timeout, reset, closed connection)
//! is not acknowledged and not remembered; the connection is replaced.

use std::io::{self, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns;
use crate::resp::{encode, Client, Reply};

#[derive(Clone, Debug)]
pub struct Config {
    pub addr: SocketAddr,
    /// Network namespace the connections are made from.
    pub netns: Option<String>,
    pub connections: u32,
    /// SETs sent back to back before reading their replies.
    pub pipeline: u32,
    pub value_len: usize,
    /// Key prefix; keys are `PREFIX:CONN:I`.
    pub prefix: String,
    /// Connect, read and write timeout.
    pub timeout: Duration,
}

/// The key of write `i` of connection `conn`.
pub fn key(prefix: &str, conn: u32, i: u64) -> String {
    format!("{prefix}:{conn}:{i}")
}

/// The value written under `key`: the key itself, then letters from a
/// generator seeded by the key, `len` bytes in all.
pub fn value(key: &str, len: usize) -> Vec<u8> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key.as_bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&key.as_bytes()[..key.len().min(len)]);
    while v.len() < len {
        h ^= h << 13;
        h ^= h >> 7;
        h ^= h << 17;
        v.push(b'a' + (h % 26) as u8);
    }
    v
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    acked: AtomicU64,
    sent: AtomicU64,
    failures: AtomicU64,
    /// A moment of interest (a kill) and the first acknowledgement of a
    /// write sent after it.
    mark: Mutex<Option<Instant>>,
    first_after_mark: Mutex<Option<Instant>>,
    /// Writes `limit` counts before the mark, and since it (`mark` zeroes it).
    sent_before_mark: AtomicU64,
    sent_after_mark: AtomicU64,
    /// `limit`'s bounds on writes sent before and after the mark.
    limit_before_mark: AtomicU64,
    limit_after_mark: AtomicU64,
    /// The last acknowledgement, and the longest time between two.
    gaps: Mutex<(Option<Instant>, Duration)>,
}

/// Writers at work; `stop` returns what they got acknowledged.
pub struct Writers {
    config: Config,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<Vec<u64>>>,
}

/// What a set of writers did.
#[derive(Debug, Default)]
pub struct Report {
    /// Acknowledged keys.
    pub acked: Vec<String>,
    /// Writes sent, acknowledged or not.
    pub sent: u64,
    /// Connections dropped on errors and timeouts.
    pub failures: u64,
}

impl Writers {
    pub fn start(config: Config) -> io::Result<Writers> {
        Writers::start_paced(config, Duration::ZERO)
    }

    /// As `start`, each connection sending a batch at most every `every`:
    /// at most `connections * pipeline` writes per `every`, however fast
    /// the server answers (a guest holds only so many keys).
    pub fn start_paced(config: Config, every: Duration) -> io::Result<Writers> {
        let shared = Arc::new(Shared::default());
        shared.limit_before_mark.store(u64::MAX, Ordering::Relaxed);
        shared.limit_after_mark.store(u64::MAX, Ordering::Relaxed);
        let mut threads = Vec::new();
        for conn in 0..config.connections {
            let (config, shared) = (config.clone(), shared.clone());
            let t = std::thread::Builder::new().name(format!("writer-{conn}")).spawn(move || {
                if let Some(ns) = &config.netns {
                    if let Err(e) = netns::enter(ns) {
                        let _ = writeln!(io::stderr(), "writer {conn}: cannot enter netns {ns}: {e}");
                        return Vec::new();
                    }
                }
                write_loop(&config, conn, &shared, every)
            })?;
            threads.push(t);
        }
        Ok(Writers { config, shared, threads })
    }

    pub fn acked(&self) -> u64 {
        self.shared.acked.load(Ordering::Relaxed)
    }

    pub fn sent(&self) -> u64 {
        self.shared.sent.load(Ordering::Relaxed)
    }

    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    /// Send at most `before_mark` writes in all until the first mark, and
    /// at most `after_mark` after each mark; the connections then wait for
    /// the next mark or `stop`. However long a trial runs on a slow host,
    /// the guest is then not filled (it would refuse further writes, and
    /// may have no room to reply).
    pub fn limit(&self, before_mark: u64, after_mark: u64) {
        self.shared.limit_before_mark.store(before_mark, Ordering::SeqCst);
        self.shared.limit_after_mark.store(after_mark, Ordering::SeqCst);
    }

    /// Note `at` (a kill); see `first_ack_after_mark`.
    pub fn mark(&self, at: Instant) {
        *self.shared.first_after_mark.lock().unwrap() = None;
        self.shared.sent_after_mark.store(0, Ordering::SeqCst);
        *self.shared.mark.lock().unwrap() = Some(at);
    }

    /// The longest a client went without an acknowledgement, counting the
    /// time since the last one (what a user of the service saw as an outage).
    pub fn longest_gap(&self) -> Duration {
        let (last, longest) = *self.shared.gaps.lock().unwrap();
        last.map_or(longest, |l| longest.max(l.elapsed()))
    }

    /// When the first write sent after the mark was acknowledged.
    pub fn first_ack_after_mark(&self) -> Option<Instant> {
        *self.shared.first_after_mark.lock().unwrap()
    }

    pub fn stop(mut self) -> Report {
        self.shared.stop.store(true, Ordering::SeqCst);
        let mut report = Report::default();
        for (conn, t) in std::mem::take(&mut self.threads).into_iter().enumerate() {
            let acked = t.join().unwrap_or_default();
            report.acked.extend(acked.into_iter().map(|i| key(&self.config.prefix, conn as u32, i)));
        }
        report.sent = self.shared.sent.load(Ordering::SeqCst);
        report.failures = self.shared.failures.load(Ordering::SeqCst);
        report
    }
}

impl Drop for Writers {
    /// Writers dropped without `stop` (a failing test) stop on their own.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

impl Shared {
    /// Take `n` writes from what `limit` allows, if it allows them.
    fn may_send(&self, n: u64) -> bool {
        let (count, limit) = if self.mark.lock().unwrap().is_some() {
            (&self.sent_after_mark, self.limit_after_mark.load(Ordering::SeqCst))
        } else {
            (&self.sent_before_mark, self.limit_before_mark.load(Ordering::SeqCst))
        };
        count.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_add(n).filter(|&t| t <= limit)).is_ok()
    }
}

/// One connection's writes until stopped; returns the acknowledged indices.
fn write_loop(config: &Config, conn: u32, shared: &Shared, every: Duration) -> Vec<u64> {
    let mut acked = Vec::new();
    let mut next_batch = Instant::now();
    let mut next = 0u64;
    let mut client: Option<Client> = None;
    let mut batch = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let c = match client.as_mut() {
            Some(c) => c,
            None => match Client::connect(config.addr, config.timeout) {
                Ok(c) => client.insert(c),
                Err(_) => {
                    shared.failures.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            },
        };
        if !shared.may_send(config.pipeline as u64) {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let now = Instant::now();
        if now < next_batch {
            std::thread::sleep(next_batch - now);
        }
        next_batch = Instant::now() + every;
        batch.clear();
        let first = next;
        for i in first..first + config.pipeline as u64 {
            let k = key(&config.prefix, conn, i);
            encode(&mut batch, &[b"SET", k.as_bytes(), &value(&k, config.value_len)]);
        }
        next += config.pipeline as u64;
        let sent_at = Instant::now();
        shared.sent.fetch_add(config.pipeline as u64, Ordering::Relaxed);
        let mut ok = c.send(&batch).is_ok();
        for i in first..next {
            if !ok {
                break;
            }
            match c.read() {
                Ok(r) if r.is_ok() => {
                    acked.push(i);
                    shared.acked.fetch_add(1, Ordering::Relaxed);
                    let mut gaps = shared.gaps.lock().unwrap();
                    let now = Instant::now();
                    if let Some(last) = gaps.0 {
                        gaps.1 = gaps.1.max(now - last);
                    }
                    gaps.0 = Some(now);
                    drop(gaps);
                    let mark = *shared.mark.lock().unwrap();
                    if mark.is_some_and(|m| sent_at >= m) {
                        let mut first = shared.first_after_mark.lock().unwrap();
                        if first.is_none() {
                            *first = Some(Instant::now());
                        }
                    }
                }
                _ => ok = false,
            }
        }
        if !ok {
            shared.failures.fetch_add(1, Ordering::Relaxed);
            client = None;
        }
    }
    acked
}

/// Outcome of reading every acknowledged key back.
#[derive(Debug, Default)]
pub struct Verified {
    pub checked: usize,
    pub missing: Vec<String>,
    pub wrong: Vec<String>,
}

impl Verified {
    pub fn lost(&self) -> usize {
        self.missing.len() + self.wrong.len()
    }
}

/// GET every key (pipelined, from `netns`) and compare it with the value
/// it was written with. Connection trouble and `-OOM` replies (a full guest
/// without room for the replies just then) are retried until `deadline`.
pub fn verify(addr: SocketAddr, netns_name: Option<&str>, keys: &[String], value_len: usize, deadline: Instant) -> io::Result<Verified> {
    let keys = keys.to_vec();
    let run = move || -> io::Result<Verified> {
        let mut out = Verified::default();
        let mut client: Option<Client> = None;
        let mut at = 0;
        while at < keys.len() {
            let c = match client.as_mut() {
                Some(c) => c,
                None => match Client::connect(addr, Duration::from_secs(2)) {
                    Ok(c) => client.insert(c),
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            let batch = &keys[at..keys.len().min(at + 64)];
            let mut req = Vec::new();
            for k in batch {
                encode(&mut req, &[b"GET", k.as_bytes()]);
            }
            let replies: io::Result<Vec<Reply>> = c.send(&req).and_then(|_| batch.iter().map(|_| c.read()).collect());
            // A full guest may have no memory for a reply just now; the
            // value is not lost, so ask again.
            let out_of_memory = |r: &Reply| matches!(r, Reply::Error(e) if e.starts_with("OOM "));
            match replies {
                Ok(replies) if replies.iter().any(out_of_memory) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Ok(replies) => {
                    for (k, r) in batch.iter().zip(replies) {
                        match r {
                            Reply::Bulk(Some(v)) if v == value(k, value_len) => {}
                            Reply::Bulk(None) => out.missing.push(k.clone()),
                            _ => out.wrong.push(k.clone()),
                        }
                    }
                    out.checked += batch.len();
                    at += batch.len();
                }
                Err(_) if Instant::now() < deadline => client = None,
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    };
    match netns_name {
        Some(ns) => netns::run_in(ns, run)?,
        None => run(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_counts_writes_before_and_after_the_mark() {
        let shared = Shared::default();
        shared.limit_before_mark.store(8, Ordering::SeqCst);
        shared.limit_after_mark.store(4, Ordering::SeqCst);
        assert!(shared.may_send(4) && shared.may_send(4));
        assert!(!shared.may_send(4), "8 before the mark");
        *shared.mark.lock().unwrap() = Some(Instant::now());
        assert!(shared.may_send(4));
        assert!(!shared.may_send(1), "4 after it");
    }

    #[test]
    fn values_are_derived_from_their_keys() {
        assert_eq!(key("demo1", 3, 42), "demo1:3:42");
        let v = value("demo1:3:42", 64);
        assert_eq!(v.len(), 64);
        assert!(v.starts_with(b"demo1:3:42"));
        assert!(v[10..].iter().all(u8::is_ascii_lowercase));
        assert_eq!(v, value("demo1:3:42", 64), "the same key gives the same value");
        assert_ne!(v, value("demo1:3:43", 64));
        assert_eq!(value("a-long-key", 4), b"a-lo", "a value shorter than its key is the key's start");
    }
}
