//! Pacing: the spacing, hold bound and maximum epoch of `--trigger output`,
//! from what checkpoints measurably cost.
//!
//! A checkpoint's *cost* is the replication thread's time for it: from the
//! pause through capture and encoding until the transport took the frame
//! (the guest pays the pause; on a host with few cores it pays the rest in
//! CPU time too). From the recent checkpoints:
//!
//! - **spacing**: an output-triggered checkpoint starts at least
//!   `SPACING_PER_PAUSE` pauses after the previous one resumed, and not
//!   before the previous one's cost has passed again, so a guest that
//!   produces output without pause spends at most a bounded share of its
//!   time stopped, and the replication thread is not kept busy
//!   back to back. With `--group-commit on` the pauses grow with the
//!   clients the recent checkpoints' output went to (two per client, up to
//!   `GROUP_SPACING_PER_PAUSE`): with many clients waiting, those whose
//!   replies the last checkpoint released send their next requests while
//!   the guest runs on, and one checkpoint carries them all (a database's
//!   group commit); with one client there is nobody to wait for.
//! - **hold bound**: held output waits for the guest to go idle at most a
//!   few costs (`HOLD_PER_COST`, at least `HOLD_FLOOR`) after the spacing.
//! - **maximum epoch** (adaptive): cost grows with the dirty pages a
//!   checkpoint carries, which grow with the epoch at the guest's dirty
//!   rate: cost(E) ≈ fixed + per_page × rate × E, the two coefficients
//!   fitted to the recent checkpoints (least squares, older ones weighing
//!   less) and the rate measured. The maximum epoch is the shortest E whose
//!   checkpoint costs at most `SHARE` of it, E = fixed / (SHARE − per_page ×
//!   rate), within [`FLOOR`, `--epoch-ms`]; `--epoch-ms` when even long
//!   epochs cannot get there. Short epochs keep the next output-triggered
//!   checkpoint small, so its output waits less; the share keeps their
//!   cost bounded.
//!
//! `--trigger periodic` uses none of this: every epoch is `--epoch-ms`.

use std::time::{Duration, Instant};

use super::{GroupCommit, Mode, Plan};

/// Checkpoint work allowed per maximum epoch.
pub const SHARE: f64 = 0.05;
/// The adaptive maximum epoch is never shorter than this (or `--epoch-ms`).
pub const FLOOR: Duration = Duration::from_millis(5);
/// Output-triggered checkpoints start at least this many (mean) pauses
/// after the previous resume: the guest is stopped at most 1/(1 + this) of
/// the time.
pub const SPACING_PER_PAUSE: u32 = 2;
/// With `--group-commit on` and four clients or more, this many pauses.
pub const GROUP_SPACING_PER_PAUSE: u32 = 8;
/// Held output waits for an idle guest at most this many (mean) costs.
pub const HOLD_PER_COST: u32 = 4;
pub const HOLD_FLOOR: Duration = Duration::from_micros(500);
/// How much the newest checkpoint weighs against the history (per sample).
const NEW_WEIGHT: f64 = 1.0 / 8.0;

/// What one checkpoint cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    /// The guest was stopped this long.
    pub pause: Duration,
    /// The replication thread's time for it (pause, capture, encoding, send).
    pub cost: Duration,
    pub dirty_pages: u64,
    /// From the previous checkpoint's resume to this one's pause.
    pub epoch: Duration,
    /// The clients its output went to (0: not counted).
    pub clients: u32,
}

/// An exponentially weighted mean.
#[derive(Clone, Copy, Debug, Default)]
struct Mean(Option<f64>);

impl Mean {
    fn add(&mut self, x: f64) {
        self.0 = Some(self.0.map_or(x, |m| m + NEW_WEIGHT * (x - m)));
    }

    fn get(&self) -> f64 {
        self.0.unwrap_or(0.0)
    }
}

/// Least squares of y on x with exponential forgetting.
#[derive(Clone, Copy, Debug, Default)]
struct Fit {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Fit {
    fn add(&mut self, x: f64, y: f64) {
        let keep = 1.0 - NEW_WEIGHT;
        self.w = self.w * keep + 1.0;
        self.x = self.x * keep + x;
        self.y = self.y * keep + y;
        self.xx = self.xx * keep + x * x;
        self.xy = self.xy * keep + x * y;
    }

    /// (intercept, slope), both at least zero; with too little spread in
    /// x to tell a slope, all of y is the intercept.
    fn line(&self) -> Option<(f64, f64)> {
        if self.w == 0.0 {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if var <= (0.1 * mx).powi(2) + 1.0 {
            return Some((my, 0.0));
        }
        let slope = ((self.xy / self.w - mx * my) / var).max(0.0);
        Some(((my - slope * mx).max(0.0), slope))
    }
}

/// The trigger's measured costs and what it derives from them.
#[derive(Clone, Debug)]
pub struct Pacing {
    mode: Mode,
    group: GroupCommit,
    /// `--epoch-ms`.
    longest: Duration,
    pause_us: Mean,
    cost_us: Mean,
    /// Cost (us) against dirty pages.
    fit: Fit,
    /// Dirty pages per second.
    rate: Mean,
    /// Clients per checkpoint.
    clients: Mean,
    /// The current maximum epoch.
    epoch: Duration,
}

impl Pacing {
    pub fn new(mode: Mode, epoch: Duration) -> Pacing {
        Pacing {
            mode,
            group: GroupCommit::Off,
            longest: epoch,
            pause_us: Mean::default(),
            cost_us: Mean::default(),
            fit: Fit::default(),
            rate: Mean::default(),
            clients: Mean::default(),
            epoch,
        }
    }

    /// Pace with `--group-commit` `group` (off unless told).
    pub fn with_group_commit(mut self, group: GroupCommit) -> Pacing {
        self.group = group;
        self
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Learn from a checkpoint just taken.
    pub fn record(&mut self, s: &Sample) {
        let cost = s.cost.as_secs_f64() * 1e6;
        self.pause_us.add(s.pause.as_secs_f64() * 1e6);
        self.cost_us.add(cost);
        self.fit.add(s.dirty_pages as f64, cost);
        if !s.epoch.is_zero() {
            self.rate.add(s.dirty_pages as f64 / s.epoch.as_secs_f64());
        }
        self.clients.add(f64::from(s.clients));
        if self.mode == Mode::Output {
            self.epoch = self.adapted();
        }
    }

    /// The shortest epoch whose checkpoint costs at most `SHARE` of it.
    fn adapted(&self) -> Duration {
        let Some((fixed_us, per_page_us)) = self.fit.line() else { return self.longest };
        let floor = FLOOR.min(self.longest);
        let room = SHARE - per_page_us * 1e-6 * self.rate.get();
        if room < SHARE / 4.0 {
            return self.longest;
        }
        Duration::from_secs_f64(fixed_us * 1e-6 / room).clamp(floor, self.longest)
    }

    /// The maximum epoch now (`--epoch-ms` unless adapted).
    pub fn max_epoch(&self) -> Duration {
        self.epoch
    }

    /// Pauses between a resume and the next output-triggered checkpoint.
    fn pauses(&self) -> f64 {
        let least = f64::from(SPACING_PER_PAUSE);
        match self.group {
            GroupCommit::On => (least * self.clients.get()).clamp(least, f64::from(GROUP_SPACING_PER_PAUSE)),
            GroupCommit::Off => least,
        }
    }

    pub fn spacing(&self) -> Duration {
        let us = (self.pause_us.get() * self.pauses()).max(self.cost_us.get() - self.pause_us.get());
        Duration::from_secs_f64(us * 1e-6)
    }

    pub fn hold_bound(&self) -> Duration {
        Duration::from_secs_f64(self.cost_us.get() * 1e-6 * f64::from(HOLD_PER_COST)).max(HOLD_FLOOR)
    }

    /// When the next checkpoint may and must start, the guest having resumed at `since`.
    pub fn plan(&self, since: Instant) -> Plan {
        Plan { mode: self.mode, since, spacing: self.spacing(), hold_bound: self.hold_bound(), max_epoch: self.epoch }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// A guest dirtying `rate` pages/s, checkpointed every `epoch`, each
    /// checkpoint costing `fixed + per_page` per dirty page.
    fn feed(p: &mut Pacing, rate: f64, epoch: Duration, fixed: u64, per_page: f64, n: usize) {
        for _ in 0..n {
            let dirty = (rate * p.max_epoch().min(epoch).as_secs_f64()) as u64;
            let cost = us(fixed + (per_page * dirty as f64) as u64);
            p.record(&Sample { pause: cost / 2, cost, dirty_pages: dirty, epoch: p.max_epoch().min(epoch), clients: 0 });
        }
    }

    #[test]
    fn periodic_never_adapts() {
        let mut p = Pacing::new(Mode::Periodic, Duration::from_millis(20));
        feed(&mut p, 100.0, Duration::from_secs(1), 100, 1.0, 50);
        assert_eq!(p.max_epoch(), Duration::from_millis(20));
    }

    #[test]
    fn a_cheap_guest_gets_short_epochs_and_a_dirtying_one_long_ones() {
        let longest = Duration::from_millis(50);
        // 200 us fixed, 2 us per page: at 1000 pages/s the page work is 0.2%
        // of the time, so E = 200 us / (5% - 0.2%) = 4.2 ms, the floor.
        let mut cheap = Pacing::new(Mode::Output, longest);
        feed(&mut cheap, 1000.0, longest, 200, 2.0, 100);
        assert_eq!(cheap.max_epoch(), FLOOR);
        // 1 ms fixed: E = 1 ms / (5% - 0.2%) = 20.8 ms.
        let mut fixed = Pacing::new(Mode::Output, longest);
        feed(&mut fixed, 1000.0, longest, 1000, 2.0, 200);
        let e = fixed.max_epoch().as_secs_f64() * 1e3;
        assert!((19.0..23.0).contains(&e), "{e} ms");
        // At 20k pages/s the pages alone cost 4% of the time: E = 1 ms / 1% would be
        // 100 ms, beyond --epoch-ms.
        let mut dirty = Pacing::new(Mode::Output, longest);
        feed(&mut dirty, 20_000.0, longest, 1000, 2.0, 200);
        assert_eq!(dirty.max_epoch(), longest);
        // Never beyond --epoch-ms, never below the floor or --epoch-ms.
        let mut short = Pacing::new(Mode::Output, Duration::from_millis(5));
        feed(&mut short, 1000.0, longest, 1000, 2.0, 100);
        assert_eq!(short.max_epoch(), Duration::from_millis(5));
    }

    #[test]
    fn spacing_and_hold_follow_the_cost() {
        let mut p = Pacing::new(Mode::Output, Duration::from_millis(20));
        for _ in 0..100 {
            p.record(&Sample { pause: us(150), cost: us(400), dirty_pages: 10, epoch: us(1000), clients: 1 });
        }
        let close = |d: Duration, want: u64| (d.as_micros() as i64 - want as i64).abs() <= 2;
        assert!(close(p.spacing(), 300), "two pauses: {:?}", p.spacing());
        assert!(close(p.hold_bound(), 1600), "four costs: {:?}", p.hold_bound());
        for _ in 0..100 {
            p.record(&Sample { pause: us(10), cost: us(100), dirty_pages: 10, epoch: us(1000), clients: 1 });
        }
        assert!(close(p.spacing(), 90), "the rest of the cost: {:?}", p.spacing());
        assert_eq!(p.hold_bound(), HOLD_FLOOR);
    }

    /// `--group-commit on`: two pauses per client the checkpoints' output
    /// went to, between two and eight; off, always two.
    #[test]
    fn group_commit_spaces_checkpoints_by_the_clients_waiting() {
        let spacing = |group: GroupCommit, clients: u32| {
            let mut p = Pacing::new(Mode::Output, Duration::from_millis(20)).with_group_commit(group);
            for _ in 0..200 {
                p.record(&Sample { pause: us(100), cost: us(150), dirty_pages: 10, epoch: us(1000), clients });
            }
            (p.spacing().as_secs_f64() * 1e6).round() as u64
        };
        assert_eq!(spacing(GroupCommit::On, 0), 200, "not counted (VSMR): two pauses");
        assert_eq!(spacing(GroupCommit::On, 1), 200, "one client: nobody to wait for");
        assert_eq!(spacing(GroupCommit::On, 3), 600);
        assert_eq!(spacing(GroupCommit::On, 50), 800, "at most eight pauses");
        assert_eq!(spacing(GroupCommit::Off, 50), 200);
    }
}
