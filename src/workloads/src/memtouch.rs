//! memtouch: the dirty-memory workload of the checkpointing papers.
//!
//! A working set of pages is split into one contiguous partition per writer
//! (vCPU). Each writer stores 8-byte values into pages of its own partition in
//! a chosen pattern. The sequence of stores depends only on the configuration,
//! never on timing, so the final contents of the working set (and their
//! checksum) after N writes per writer can be recomputed anywhere: in the
//! guest, on the host in a test, or after a failover.

use core::fmt;

pub const PAGE_SIZE: u64 = 4096;
const WORDS_PER_PAGE: u64 = PAGE_SIZE / 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Page 0, 1, 2, ... of the partition, wrapping.
    Sequential,
    /// Uniformly random pages of the partition.
    Random,
    /// `hot_permille` of the pages receive `hot_prob_permille` of the writes;
    /// with `shift` > 0 the hot pages move on by their own number every
    /// `shift` writes of a writer (a guest that changes its ways).
    HotCold { hot_permille: u32, hot_prob_permille: u32, shift: u64 },
    /// Every `stride`-th page, wrapping modulo the partition size.
    Strided { stride: u64 },
}

/// Everything that determines what memtouch writes, plus how it runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    /// Working-set size in pages (whole set, all writers).
    pub ws_pages: u64,
    pub pattern: Pattern,
    pub seed: u64,
    /// Writers (vCPUs); 0 means "every vCPU of the VM".
    pub writers: u32,
    /// Writes per second per writer; 0 means unthrottled.
    pub rate: u64,
    /// Stop after this many writes per writer (0: no limit).
    pub writes: u64,
    /// Stop after this long (0: no limit). With `writes` also set, whichever
    /// comes first.
    pub duration_ms: u64,
    /// Progress report interval (0: no progress lines).
    pub report_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ws_pages: 16 << 20 >> 12,
            pattern: Pattern::Random,
            seed: 1,
            writers: 0,
            rate: 0,
            writes: 0,
            duration_ms: 3000,
            report_ms: 500,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseError(pub &'static str);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

fn parse_u64(s: &str) -> Result<u64, ParseError> {
    s.parse().map_err(|_| ParseError("expected an unsigned integer"))
}

/// `64M`, `512K`, `1G` or plain bytes.
fn parse_size(s: &str) -> Result<u64, ParseError> {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    parse_u64(num)?.checked_mul(mult).ok_or(ParseError("size too large"))
}

/// `3s`, `500ms` or plain milliseconds.
fn parse_ms(s: &str) -> Result<u64, ParseError> {
    if let Some(n) = s.strip_suffix("ms") {
        parse_u64(n)
    } else if let Some(n) = s.strip_suffix('s') {
        parse_u64(n)?.checked_mul(1000).ok_or(ParseError("duration too large"))
    } else {
        parse_u64(s)
    }
}

/// Parse a fraction like `0.1` into permille.
fn parse_permille(s: &str) -> Result<u32, ParseError> {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let int: u32 = if int.is_empty() { 0 } else { int.parse().map_err(|_| ParseError("bad fraction"))? };
    let mut permille = int.checked_mul(1000).ok_or(ParseError("bad fraction"))?;
    let mut scale = 100;
    for c in frac.bytes().take(3) {
        if !c.is_ascii_digit() {
            return Err(ParseError("bad fraction"));
        }
        permille += (c - b'0') as u32 * scale;
        scale /= 10;
    }
    if permille > 1000 {
        return Err(ParseError("fraction must be within 0..1"));
    }
    Ok(permille)
}

impl Config {
    /// Parse a command line of `key=value` words:
    /// `ws=SIZE pattern=seq|random|hotcold|strided hot=FRAC hotprob=FRAC
    /// shift=N stride=N seed=N vcpus=N rate=N writes=N duration=TIME report=TIME`.
    /// Unknown keys are an error so typos do not silently change a run.
    pub fn parse(cmdline: &str) -> Result<Config, ParseError> {
        let mut c = Config::default();
        let (mut hot, mut hotprob, mut stride, mut shift) = (100, 900, 3, 0);
        let mut pattern = "random";
        let mut writes_given = false;
        let mut duration_given = false;
        for word in cmdline.split_ascii_whitespace() {
            let (key, value) = word.split_once('=').ok_or(ParseError("expected key=value"))?;
            match key {
                "ws" => c.ws_pages = parse_size(value)? / PAGE_SIZE,
                "pattern" => pattern = value,
                "hot" => hot = parse_permille(value)?,
                "hotprob" => hotprob = parse_permille(value)?,
                "stride" => stride = parse_u64(value)?,
                "shift" => shift = parse_u64(value)?,
                "seed" => c.seed = parse_u64(value)?,
                "vcpus" => c.writers = parse_u64(value)? as u32,
                "rate" => c.rate = parse_u64(value)?,
                "writes" => {
                    c.writes = parse_u64(value)?;
                    writes_given = true;
                }
                "duration" => {
                    c.duration_ms = parse_ms(value)?;
                    duration_given = true;
                }
                "report" => c.report_ms = parse_ms(value)?,
                _ => return Err(ParseError("unknown memtouch option")),
            }
        }
        // A run bounded by a write count must not also be cut short by the
        // default duration: its checksum would then depend on timing.
        if writes_given && !duration_given {
            c.duration_ms = 0;
        }
        c.pattern = match pattern {
            "seq" | "sequential" => Pattern::Sequential,
            "random" => Pattern::Random,
            "hotcold" => Pattern::HotCold { hot_permille: hot, hot_prob_permille: hotprob, shift },
            "strided" => Pattern::Strided { stride },
            _ => return Err(ParseError("pattern must be seq, random, hotcold or strided")),
        };
        if c.ws_pages == 0 {
            return Err(ParseError("working set must be at least one page"));
        }
        Ok(c)
    }

    /// Page range `[first, first + count)` of the working set owned by `writer`.
    pub fn partition(&self, writer: u32, writers: u32) -> (u64, u64) {
        let w = writers.max(1) as u64;
        let first = self.ws_pages * writer as u64 / w;
        let end = self.ws_pages * (writer as u64 + 1) / w;
        (first, end - first)
    }
}

/// xorshift64*: fast, and identical on every platform.
#[derive(Clone, Copy, Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64, writer: u32) -> Rng {
        // splitmix64 of the inputs, so nearby seeds give unrelated streams.
        let mut z = seed ^ ((writer as u64 + 1) << 40) ^ 0x9E37_79B9_7F4A_7C15;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    #[inline(always)]
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Uniform index below `n` without a division.
#[inline(always)]
fn below(r: u64, n: u64) -> u64 {
    ((r as u128 * n as u128) >> 64) as u64
}

/// One writer's deterministic stream of stores into its partition.
#[derive(Clone, Debug)]
pub struct Writer {
    first_page: u64,
    pages: u64,
    pattern: Pattern,
    hot_pages: u64,
    hot_threshold: u64,
    /// Writes between moves of the hot pages (0: they stay).
    shift: u64,
    rng: Rng,
    cursor: u64,
    salt: u64,
    /// Writes done so far.
    pub done: u64,
}

impl Writer {
    pub fn new(config: &Config, writer: u32, writers: u32) -> Writer {
        let (first_page, pages) = config.partition(writer, writers);
        let (hot_pages, hot_threshold, shift) = match config.pattern {
            Pattern::HotCold { hot_permille, hot_prob_permille, shift } => {
                ((pages * hot_permille as u64 / 1000).clamp(1, pages.max(1)), (1u64 << 16) * hot_prob_permille as u64 / 1000, shift)
            }
            _ => (0, 0, 0),
        };
        Writer {
            first_page,
            pages,
            pattern: config.pattern,
            hot_pages,
            hot_threshold,
            shift,
            rng: Rng::new(config.seed, writer),
            cursor: 0,
            salt: config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ writer as u64,
            done: 0,
        }
    }

    /// Page of the working set (not of the partition) the next write goes to.
    #[inline(always)]
    fn next_page(&mut self) -> u64 {
        let n = self.pages;
        let local = match self.pattern {
            Pattern::Sequential => {
                let p = self.cursor;
                self.cursor = if p + 1 == n { 0 } else { p + 1 };
                p
            }
            Pattern::Random => below(self.rng.next(), n),
            Pattern::HotCold { .. } => {
                let r = self.rng.next();
                let at = if (r & 0xffff) < self.hot_threshold || self.hot_pages == n {
                    below(r, self.hot_pages)
                } else {
                    self.hot_pages + below(r, n - self.hot_pages)
                };
                // Where the hot pages start now; no division per write
                // unless they move.
                match self.done.checked_div(self.shift) {
                    None => at,
                    Some(shifts) => (at + shifts.wrapping_mul(self.hot_pages) % n) % n,
                }
            }
            Pattern::Strided { stride } => {
                let p = self.cursor;
                self.cursor = (p + stride % n) % n;
                p
            }
        };
        self.first_page + local
    }

    /// Perform `count` writes into the working set starting at `ws`, calling
    /// `on_page` with each written page index (for dirty-page accounting).
    ///
    /// # Safety
    /// `ws` must point to `config.ws_pages` writable pages, and no one else may
    /// write this writer's partition concurrently.
    #[inline(always)]
    pub unsafe fn run(&mut self, ws: *mut u64, count: u64, mut on_page: impl FnMut(u64)) {
        if self.pages == 0 {
            self.done += count;
            return;
        }
        for _ in 0..count {
            let k = self.done;
            let page = self.next_page();
            let word = page * WORDS_PER_PAGE + k % WORDS_PER_PAGE;
            // SAFETY: `page` is inside this writer's partition (next_page only
            // yields indices below `pages`), which the caller guarantees is
            // mapped, writable and ours alone.
            unsafe { ws.add(word as usize).write(k ^ self.salt) };
            on_page(page);
            self.done = k + 1;
        }
    }
}

/// Checksum of a working set, as printed in `memtouch: done checksum=...`.
pub fn checksum(ws: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(ws)
}

#[cfg(test)]
mod tests {
    use super::*;
    extern crate std;
    use std::vec;

    #[test]
    fn parses_all_options() {
        let c = Config::parse("ws=1M pattern=hotcold hot=0.25 hotprob=0.75 seed=9 vcpus=2 rate=100 writes=5 report=1s").unwrap();
        assert_eq!(c.ws_pages, 256);
        assert_eq!(c.pattern, Pattern::HotCold { hot_permille: 250, hot_prob_permille: 750, shift: 0 });
        assert_eq!((c.seed, c.writers, c.rate, c.writes, c.report_ms), (9, 2, 100, 5, 1000));
        assert_eq!(c.duration_ms, 0, "a write-bounded run has no default time limit");
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn rejects_bad_options() {
        assert!(Config::parse("bogus=1").is_err());
        assert!(Config::parse("ws").is_err());
        assert!(Config::parse("pattern=zigzag").is_err());
        assert!(Config::parse("hot=1.5").is_err());
        assert!(Config::parse("ws=100").is_err());
    }

    #[test]
    fn partitions_cover_the_working_set() {
        let c = Config { ws_pages: 1001, ..Config::default() };
        let parts: vec::Vec<_> = (0..3).map(|w| c.partition(w, 3)).collect();
        assert_eq!(parts[0].0, 0);
        assert_eq!(parts[2].0 + parts[2].1, 1001);
        assert_eq!(parts[0].0 + parts[0].1, parts[1].0);
    }

    fn pages_touched(spec: &str, writes: u64) -> vec::Vec<u64> {
        let c = Config::parse(spec).unwrap();
        let mut ws = vec![0u64; (c.ws_pages * WORDS_PER_PAGE) as usize];
        let mut touched = vec![0u64; c.ws_pages as usize];
        let mut w = Writer::new(&c, 0, 1);
        // SAFETY: `ws` holds the whole working set and only this writer.
        unsafe { w.run(ws.as_mut_ptr(), writes, |p| touched[p as usize] += 1) };
        touched
    }

    #[test]
    fn sequential_and_strided_visit_every_page() {
        assert!(pages_touched("ws=64K pattern=seq", 16).iter().all(|&n| n == 1));
        assert!(pages_touched("ws=64K pattern=strided stride=3", 16).iter().all(|&n| n == 1));
    }

    #[test]
    fn hotcold_concentrates_writes() {
        let t = pages_touched("ws=400K pattern=hotcold hot=0.1 hotprob=0.9", 100_000);
        let hot: u64 = t[..10].iter().sum();
        assert!(hot > 85_000 && hot < 95_000, "hot writes {hot}");
    }

    #[test]
    fn shifted_hot_pages_move_on_by_their_number() {
        // 100 pages, 10 hot; the hot pages move every 10,000 writes.
        let spec = "ws=400K pattern=hotcold hot=0.1 hotprob=0.9 shift=10000";
        let t = pages_touched(spec, 10_000);
        assert!(t[..10].iter().sum::<u64>() > 8_500, "first the first ten pages are hot");
        let t = pages_touched(spec, 20_000);
        assert!(t[10..20].iter().sum::<u64>() > 8_500, "then the next ten: {:?}", &t[..30]);
    }

    #[test]
    fn same_config_same_checksum() {
        let run = |seed| {
            let c = Config::parse(&std::format!("ws=64K seed={seed}")).unwrap();
            let mut ws = vec![0u64; (c.ws_pages * WORDS_PER_PAGE) as usize];
            let mut w = Writer::new(&c, 0, 1);
            // SAFETY: `ws` holds the whole working set and only this writer.
            unsafe { w.run(ws.as_mut_ptr(), 1000, |_| {}) };
            // SAFETY: the bytes of `ws`'s initialized u64s, borrowed while `ws`
            // lives; u8 has no alignment or validity requirement.
            checksum(unsafe { core::slice::from_raw_parts(ws.as_ptr() as *const u8, ws.len() * 8) })
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }
}
