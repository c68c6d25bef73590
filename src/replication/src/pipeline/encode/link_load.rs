//! `--diff auto`: diffs LZ4-compressed only while the link is the bound.
//!
//! Compressing a checkpoint's diffs about halves its bytes (kv at -P 1: 34
//! KB to 19 KB a checkpoint), but it costs the primary's replication thread
//! some 40 µs a checkpoint and the backup its decompression; a link that
//! moves the stream with room to spare gains nothing from the bytes saved.
//! How busy the link is, TCP measures itself: the time the connection had
//! data in flight, unacknowledged (`tcpi_busy_time`), against the time
//! passed. That share also counts the backup's time to apply a checkpoint
//! before its acknowledgement carries TCP's (0.1 to 0.5 of the time on a
//! loopback link with room to spare, up to 0.9 under a writer that keeps
//! the backup busy, where fewer bytes also spare the backup a copy), so a
//! share above `ON` over a window of `WINDOW` turns compression on, and one
//! below `OFF` turns it off again. `ON` is not higher because plain diffs
//! are 2-4 times the bytes: kv SET -P 16 sent 123 KB a checkpoint plain
//! against 30 KB compressed, a millisecond on a 1 Gbit/s link at 450
//! checkpoints a second, which such a link shows as a share near 0.6.
//! (TCP's delivery rate would not do: a token bucket's bursts and 64 KiB
//! segments make it read gigabytes a second on a link throttled to
//! megabits.)
//!
//! A checkpoint of `BIG_CHECKPOINT` pages or more is compressed whatever
//! the share: megabytes of plain diffs lengthen its way to the
//! acknowledgement (sent, copied, applied) more than compressing them
//! costs, which the busy share, read over windows of many small
//! checkpoints, does not show (memtouch rewriting 4096 pages at 20 ms
//! reached 0.68 of unreplicated with plain diffs against 0.76 compressed,
//! the share at 0.3-0.45 all along). A request-response service's
//! checkpoints are tens to a few hundred pages: plain, unless the link is
//! busy.

use std::time::{Duration, Instant};

/// Busy share above which diffs are compressed.
pub const ON: f64 = 0.6;
/// Busy share below which they go plain again.
pub const OFF: f64 = 0.3;
/// The span each share is measured over.
pub const WINDOW: Duration = Duration::from_millis(100);
/// Pages from which a checkpoint's diffs are compressed, link busy or not.
pub const BIG_CHECKPOINT: usize = 1024;

/// The link's busy share, and whether diffs are compressed now.
#[derive(Debug, Default)]
pub struct LinkLoad {
    /// Where the current window began: the time and the busy time then.
    start: Option<(Instant, Duration)>,
    compress: bool,
}

impl LinkLoad {
    pub fn new() -> LinkLoad {
        LinkLoad::default()
    }

    pub fn compressing(&self) -> bool {
        self.compress
    }

    /// Whether a checkpoint of `pages` pages goes compressed.
    pub fn compress_checkpoint(&self, pages: usize) -> bool {
        self.compress || pages >= BIG_CHECKPOINT
    }

    /// The link's busy time read at `now` (None: the link does not say).
    /// Some(compress) when the choice changes.
    pub fn observe(&mut self, now: Instant, busy: Option<Duration>) -> Option<bool> {
        let busy = busy?;
        let Some((t0, b0)) = self.start else {
            self.start = Some((now, busy));
            return None;
        };
        let span = now.saturating_duration_since(t0);
        if span < WINDOW {
            return None;
        }
        self.start = Some((now, busy));
        let share = busy.saturating_sub(b0).as_secs_f64() / span.as_secs_f64();
        let compress = if self.compress { share >= OFF } else { share > ON };
        tracing::debug!(busy_share = format!("{share:.2}"), compress, "replication link load");
        (compress != self.compress).then(|| {
            self.compress = compress;
            tracing::info!(busy_share = format!("{share:.2}"), compress, "diff compression follows the link's load");
            compress
        })
    }

    /// A new connection: its busy time starts over.
    pub fn restart(&mut self) {
        self.start = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `n` windows in which the link is busy `share` of the time.
    fn feed(l: &mut LinkLoad, t: &mut Instant, busy: &mut Duration, share: f64, n: usize) -> Vec<bool> {
        let mut changes = Vec::new();
        for _ in 0..n {
            *t += WINDOW;
            *busy += WINDOW.mul_f64(share);
            changes.extend(l.observe(*t, Some(*busy)));
        }
        changes
    }

    #[test]
    fn compresses_while_the_link_is_saturated_with_a_gap_between_on_and_off() {
        let mut l = LinkLoad::new();
        let (mut t, mut busy) = (Instant::now(), Duration::ZERO);
        assert_eq!(l.observe(t, Some(busy)), None, "the first look only starts a window");
        assert!(feed(&mut l, &mut t, &mut busy, 0.3, 5).is_empty(), "a LAN checkpoint stream");
        assert!(feed(&mut l, &mut t, &mut busy, 0.55, 5).is_empty(), "a backup kept busy");
        assert_eq!(feed(&mut l, &mut t, &mut busy, 0.99, 3), vec![true], "a saturated link");
        assert!(l.compressing());
        assert!(feed(&mut l, &mut t, &mut busy, 0.4, 5).is_empty(), "compressed, the share falls: stays on");
        assert_eq!(feed(&mut l, &mut t, &mut busy, 0.1, 2), vec![false], "the link has room again");
        assert!(!l.compressing());
    }

    #[test]
    fn a_link_that_does_not_say_or_a_short_span_changes_nothing() {
        let mut l = LinkLoad::new();
        let t = Instant::now();
        assert_eq!(l.observe(t, None), None);
        assert_eq!(l.observe(t, Some(Duration::ZERO)), None);
        assert_eq!(l.observe(t + WINDOW / 2, Some(WINDOW / 2)), None, "under a window: not judged yet");
        assert_eq!(l.observe(t + WINDOW, Some(WINDOW)), Some(true));
        l.restart();
        assert_eq!(l.observe(t + WINDOW * 3, Some(Duration::ZERO)), None, "a new connection's busy time starts over");
    }

    #[test]
    fn a_big_checkpoint_is_compressed_on_a_link_with_room() {
        let l = LinkLoad::new();
        assert!(!l.compressing());
        assert!(!l.compress_checkpoint(BIG_CHECKPOINT - 1));
        assert!(l.compress_checkpoint(BIG_CHECKPOINT));
    }
}
