//! What the adaptive mechanisms weigh against each other, per page, as
//! measured on this host: a tracked first write the guest takes, and the
//! copy, hash and encoding of a page the checkpoint carries.
//!
//! Write prediction keeps a page writable to save the guest a tracked first
//! write, and pays a copy and a hash for it every epoch it is not written;
//! a prefetch round that sends a page the guest writes again costs the
//! guest one more tracked first write, and one that holds saves the pause
//! a copy. Where each pays depends on these figures, which differ from host
//! to host by an order of magnitude (a first write is about 0.3 µs with
//! hardware dirty logging, about 6 µs under this host's shadow paging), so
//! `--tuning auto` measures them at start (`policy`), in a few
//! milliseconds, and the thresholds follow from them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Per-page costs, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Costs {
    /// A tracked first write: the guest's write to a write-protected page.
    pub first_write_ns: u32,
    /// Copying a page out of guest memory (the stop-and-copy, per page).
    pub copy_ns: u32,
    /// Hashing a page (the fake-dirty filter, per page kept writable).
    pub hash_ns: u32,
    /// Encoding a rewritten page for the link (a diff against the copy
    /// the backup holds).
    pub encode_ns: u32,
    /// Write-protecting a page the guest has mapped, as copy-on-write
    /// capture does in the pause (0: not measured).
    #[serde(default)]
    pub protect_ns: u32,
    /// Whether these were measured on this host (`false`: assumed).
    pub measured: bool,
    /// The copy cost the mechanisms' thresholds were last set from.
    #[serde(skip)]
    pub(crate) last_passed: u32,
}

impl Default for Costs {
    /// The figures measured once on the development host (nested KVM,
    /// shadow paging): what is assumed where nothing was measured.
    fn default() -> Costs {
        Costs { first_write_ns: 6000, copy_ns: 1000, hash_ns: 200, encode_ns: 1500, protect_ns: 0, measured: false, last_passed: 1000 }
    }
}

/// The fewest pages a stop-and-copy must copy to count in `follow_copy`.
const FOLLOW_FROM: u64 = 64;

impl Costs {
    /// A stop-and-copy copied `pages` pages in `took`: follow the copy cost
    /// of the guest's own pages (colder in the caches than a calibration's,
    /// and slower while the host is loaded), weighted over about eight
    /// checkpoints. Only measured costs follow (assumed ones stay as they
    /// are, so `--tuning static` is reproducible); a copy of few pages says
    /// little. Whether the cost moved by more than a tenth (then the
    /// thresholds are worth passing on).
    pub fn follow_copy(&mut self, pages: u64, took: Duration) -> bool {
        if !self.measured || pages < FOLLOW_FROM {
            return false;
        }
        let now = (took.as_nanos() / u128::from(pages)).clamp(1, u32::MAX as u128) as u64;
        let before = u64::from(self.copy_ns);
        let next = (before * 7 + now) / 8;
        self.copy_ns = next as u32;
        next.abs_diff(self.last_passed.into()) * 10 > u64::from(self.last_passed)
    }

    /// The thresholds were passed on at the current copy cost.
    pub fn passed(&mut self) {
        self.last_passed = self.copy_ns;
    }

    /// Whether copy-on-write capture pays: write-protecting a page in the
    /// pause costs less than half of copying it (the rest of the copy's
    /// saving goes to the guest's writes that wait for a page's copy after
    /// the resume). Never without a measurement.
    pub fn protect_pays(&self) -> bool {
        self.protect_ns > 0 && self.protect_ns * 2 < self.copy_ns
    }

    /// The share of its kept pages a region must see written each epoch for
    /// keeping it writable to pay: a kept page that is written saves a
    /// tracked first write; one that is not costs a copy and a hash.
    pub fn keep_threshold(&self) -> f32 {
        let cost = self.copy_ns as f32 + self.hash_ns as f32;
        (cost / (cost + self.first_write_ns as f32)).clamp(0.01, 0.9)
    }

    /// The largest share of a prefetch round's sends that may be written
    /// again before the freeze: a wasted send costs the guest a tracked
    /// first write, a useful one saves the pause a page's copy.
    pub fn max_waste(&self) -> f64 {
        let saved = self.copy_ns as f64;
        (saved / (saved + self.first_write_ns as f64)).clamp(0.01, 0.9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_assumed_costs_give_the_thresholds_measured_on_the_development_host() {
        let c = Costs::default();
        assert!((c.keep_threshold() - 1.0 / 6.0).abs() < 0.01, "{}", c.keep_threshold());
        assert!((c.max_waste() - 1.0 / 7.0).abs() < 0.01, "{}", c.max_waste());
    }

    /// Cheaper first writes (hardware dirty logging) make keeping a page
    /// and wasting a send each pay less often.
    #[test]
    fn cheaper_first_writes_raise_both_thresholds() {
        let slow = Costs::default();
        let fast = Costs { first_write_ns: 300, ..slow };
        assert!(fast.keep_threshold() > slow.keep_threshold());
        assert!(fast.max_waste() > slow.max_waste());
    }

    #[test]
    fn measured_copies_follow_the_stop_and_copy_and_assumed_ones_stay() {
        let mut assumed = Costs::default();
        assert!(!assumed.follow_copy(1000, Duration::from_millis(10)));
        assert_eq!(assumed, Costs::default());
        let mut c = Costs { measured: true, ..Costs::default() };
        c.passed();
        assert!(!c.follow_copy(10, Duration::from_millis(10)), "too few pages to say anything");
        // 4 µs a page now: an eighth of the way there, more than a tenth off.
        assert!(c.follow_copy(1000, Duration::from_millis(4)));
        assert_eq!(c.copy_ns, (1000 * 7 + 4000) / 8);
        c.passed();
        assert!(!c.follow_copy(1000, Duration::from_micros(1400)), "within a tenth of what was passed on");
    }

    #[test]
    fn copy_on_write_pays_only_where_protecting_is_measured_cheap() {
        let c = Costs { measured: true, copy_ns: 1000, ..Costs::default() };
        assert!(!c.protect_pays(), "not measured");
        assert!(!Costs { protect_ns: 900, ..c }.protect_pays(), "about a copy: the pause gains nothing");
        assert!(Costs { protect_ns: 300, ..c }.protect_pays());
    }
}
