//! Lines about refused connections, rate-limited: a port that strangers
//! flood (probes, wrong secrets, idle sockets) logs the first few refusals
//! of each interval one by one and then one line with how many more there
//! were, so 300 strangers are a handful of lines, not 300.

use std::fmt::Display;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ftvm_vmm::sync::Lock;

/// Refusals logged one by one per interval.
pub const FIRST: u32 = 10;
/// The interval a summary line covers.
pub const INTERVAL: Duration = Duration::from_secs(10);

pub struct Refusals {
    /// What is refused, plural ("connections", "peer links").
    name: &'static str,
    window: Mutex<Window>,
}

struct Window {
    /// The first refusal of this interval; none yet: None.
    start: Option<Instant>,
    logged: u32,
    more: u64,
}

impl Refusals {
    pub fn new(name: &'static str) -> Refusals {
        Refusals { name, window: Mutex::new(Window { start: None, logged: 0, more: 0 }) }
    }

    /// Log `line` (a refusal of `peer`) as a warning, unless this interval
    /// has had its share: then it is only counted, for `tick`'s summary.
    pub fn warn(&self, peer: &dyn Display, line: &dyn Display) {
        let mut w = self.window.locked();
        let now = Instant::now();
        self.roll(&mut w, now);
        w.start.get_or_insert(now);
        if w.logged < FIRST {
            w.logged += 1;
            drop(w);
            tracing::warn!(%peer, "{line}");
        } else {
            w.more += 1;
        }
    }

    /// Once the interval is over: the summary of what it did not log, and
    /// a new interval. Called on the owner's tick.
    pub fn tick(&self) {
        let mut w = self.window.locked();
        self.roll(&mut w, Instant::now());
    }

    fn roll(&self, w: &mut Window, now: Instant) {
        if w.start.is_none_or(|start| now.duration_since(start) < INTERVAL) {
            return;
        }
        if w.more > 0 {
            tracing::warn!(
                "refused {} more {} in the last {} s (only the first {FIRST} of each interval are logged one by one)",
                w.more,
                self.name,
                INTERVAL.as_secs()
            );
        }
        *w = Window { start: None, logged: 0, more: 0 };
    }

    #[cfg(test)]
    fn counts(&self) -> (u32, u64) {
        let w = self.window.locked();
        (w.logged, w.more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_first_few_refusals_are_counted_and_a_new_interval_starts_afresh() {
        let r = Refusals::new("connections");
        for i in 0..300 {
            r.warn(&"127.0.0.1:1", &format_args!("refused a connection: {i}"));
        }
        assert_eq!(r.counts(), (FIRST, 300 - FIRST as u64));
        let start = r.window.locked().start.unwrap();
        r.window.locked().start = Some(start.checked_sub(INTERVAL).unwrap());
        r.tick();
        assert_eq!(r.counts(), (0, 0));
        r.warn(&"127.0.0.1:1", &"refused a connection");
        assert_eq!(r.counts(), (1, 0));
    }
}
