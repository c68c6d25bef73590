//! `--tuning`: which of the papers' mechanisms run when the user names
//! none. `auto` (the default) runs the adaptive ones, each judging per
//! region and per epoch from what the guest does and from the costs
//! measured at start whether it pays where it is: write prediction keeps
//! the regions the guest rewrites writable, prefetch sends the write-cold
//! rest ahead during the epoch, and everything else is tracked and sent at
//! the checkpoint; the fake-ACK proxy acknowledges early the flows it finds
//! carrying bulk data, and VSMR's `syncvm` sends a divergent page's
//! changed blocks while little of such pages differs. `static` is the pipeline as it was before: Remus with
//! sub-page diffs, every dirty page tracked and sent at the checkpoint.
//! A switch given on the command line overrides the policy either way.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ftvm_vmm::memory::{AlignedPage, PAGE};
use ftvm_vmm::switch;

use super::costs::Costs;
use super::encode::hash_compare::Granularity;
use super::predict::FakeDirtyFilter;
use super::{capture, encode, predict, prefetch};
use crate::fakeack;

switch! {
    /// `--tuning`: who chooses the mechanisms not named on the command line.
    pub enum Tuning {
        /// The adaptive mechanisms, weighing the costs measured at start.
        Auto = "auto",
        /// None of them: every dirty page tracked and sent at the checkpoint.
        Static = "static",
    }
}

/// `--predict-writes`, or the policy's choice: adaptive under `auto`,
/// except with the dirty ring (which re-protects every page it harvests,
/// so none can be left writable); given explicitly beside the ring it
/// stays, and the pipeline refuses the pair with a reason.
pub fn predict_writes(tuning: Tuning, given: Option<predict::Mode>, dirty_ring: bool) -> predict::Mode {
    match (given, tuning) {
        (Some(mode), _) => mode,
        (None, Tuning::Static) => predict::Mode::Off,
        (None, Tuning::Auto) if dirty_ring => {
            tracing::info!("not predicting writes: the dirty ring re-protects every page it harvests (--dirty-backend ring)");
            predict::Mode::Off
        }
        (None, Tuning::Auto) => predict::Mode::Adaptive,
    }
}

/// `--prefetch`, or the policy's choice: adaptive under `auto` (its
/// rounds run only as early in the epoch as few of their sends are
/// wasted, and not at all while even the last one alone wastes).
pub fn prefetch(tuning: Tuning, given: Option<prefetch::Mode>) -> prefetch::Mode {
    match (given, tuning) {
        (Some(mode), _) => mode,
        (None, Tuning::Static) => prefetch::Mode::Off,
        (None, Tuning::Auto) => prefetch::Mode::Adaptive,
    }
}

/// `--diff`, or the policy's choice: `lz4` either way. `auto` (plain XOR
/// diffs unless the link is busy or the checkpoint big) sends 2-4 times the
/// bytes, and on this host the primary's CPU per request came out 5-13%
/// higher with it in 5 of 8 cost cases (kv and redis-server, GET and SET,
/// -P 1 and -P 16; 3 interleaved rounds, `ftvm-bench cost --variant="--diff
/// lz4"` with `auto` as the default): the compression it saves (15-40% of
/// the encoding) is less than the TCP send of the bytes it adds.
pub fn diff(_tuning: Tuning, given: Option<encode::Diff>) -> encode::Diff {
    given.unwrap_or(encode::Diff::Lz4)
}

/// `--fake-ack`, or the policy's choice: under `auto`, `bulk`: held data
/// is acknowledged early only on the flows found carrying bulk data
/// (`fakeack::flow::Flow::classify`), where it measured 1.6x faster, and
/// not on request/response flows, where it measured up to 18% slower.
pub fn fake_ack(tuning: Tuning, given: Option<fakeack::Mode>) -> fakeack::Mode {
    match (given, tuning) {
        (Some(mode), _) => mode,
        (None, Tuning::Static) => fakeack::Mode::Off,
        (None, Tuning::Auto) => fakeack::Mode::Bulk,
    }
}

/// `ftvm replica --sync-pages`, or the policy's choice: under `auto`,
/// `adaptive`: a divergent page goes as its changed blocks while the
/// measured share of a divergent page that differs is small, else whole
/// (`encode::hash_compare::ByDivergence`).
pub fn sync_pages(tuning: Tuning, given: Option<Granularity>) -> Granularity {
    match (given, tuning) {
        (Some(mode), _) => mode,
        (None, Tuning::Static) => Granularity::Whole,
        (None, Tuning::Auto) => Granularity::Adaptive,
    }
}

/// `--capture`, or the policy's choice: copy-on-write under `auto` where
/// the probe at start found write-protecting a page much cheaper than
/// copying it (on this project's host it costs about as much), else the
/// copy in the pause.
pub fn capture(tuning: Tuning, given: Option<capture::Mode>, costs: &Costs) -> capture::Mode {
    match (given, tuning) {
        (Some(mode), _) => mode,
        (None, Tuning::Auto) if costs.protect_pays() => capture::Mode::Cow,
        (None, _) => capture::Mode::Pause,
    }
}

/// The costs the adaptive mechanisms weigh: measured on this host under
/// `auto` (once per process), assumed under `static`.
pub fn costs(tuning: Tuning, diff: encode::Diff) -> Costs {
    match tuning {
        Tuning::Static => Costs::default(),
        Tuning::Auto => *MEASURED.get_or_init(|| measure(diff)),
    }
}

static MEASURED: OnceLock<Costs> = OnceLock::new();

fn measure(diff: encode::Diff) -> Costs {
    let assumed = Costs::default();
    let ns = |ns: f64| Duration::from_nanos(ns.round() as u64);
    let (first_write, protect) = match ftvm_vmm::calibrate::tracked_first_write(ftvm_vmm::calibrate::DEFAULT_PAGES) {
        // What keeping a page writable saves: the tracked write's cost beyond an untracked one's.
        Ok(cost) => (ns(cost.tracking_ns()), cost.protect_ns.map(ns)),
        Err(err) => {
            tracing::warn!(%err, assumed_ns = assumed.first_write_ns, "cannot measure a tracked first write; assuming");
            (Duration::from_nanos(assumed.first_write_ns.into()), None)
        }
    };
    let costs = host_costs(first_write, protect, diff);
    tracing::info!(
        first_write_ns = costs.first_write_ns,
        copy_ns = costs.copy_ns,
        hash_ns = costs.hash_ns,
        encode_ns = costs.encode_ns,
        protect_ns = costs.protect_ns,
        keep_from = costs.keep_threshold(),
        max_waste = costs.max_waste(),
        "measured this host's costs per page"
    );
    costs
}

/// Pages each host-side measurement runs over: 8 MiB, beyond the caches a
/// page copied from guest memory would find it in.
const PAGES: usize = 2048;
/// Times each measurement runs; the fastest counts (the others were
/// disturbed by the host's other work).
const TRIES: usize = 3;

/// The host-side costs measured on this host, with `first_write` and
/// `protect` (both need a guest: `ftvm_vmm::calibrate`).
fn host_costs(first_write: Duration, protect: Option<Duration>, diff: encode::Diff) -> Costs {
    let mut source: Vec<AlignedPage> = vec![AlignedPage::ZERO; PAGES];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for page in &mut source {
        for word in page.0.chunks_exact_mut(8) {
            // xorshift: content neither zero nor compressible.
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            word.copy_from_slice(&seed.to_le_bytes());
        }
    }
    let mut copies = vec![AlignedPage::ZERO; PAGES];
    let copy = fastest(|| {
        for (to, from) in copies.iter_mut().zip(&source) {
            to.0.copy_from_slice(&from.0);
        }
        std::hint::black_box(&copies);
    });
    let hash = fastest(|| {
        for page in &source {
            std::hint::black_box(FakeDirtyFilter::hash(&page.0));
        }
    });
    // A rewrite as services do it: a few words of a page the backup holds.
    let mut encoder = encode::new(encode::Encoding::Raw, diff, PAGES as u64);
    let mut out = Vec::with_capacity(PAGE * 2);
    for (p, page) in source.iter().enumerate() {
        out.clear();
        encoder.encode(p as u64, &page.0, &mut out);
    }
    let mut round = 0u64;
    let encode = fastest(|| {
        round += 1;
        for (p, page) in source.iter_mut().enumerate() {
            page.0[(round as usize * 64) % PAGE..][..8].copy_from_slice(&round.to_le_bytes());
            out.clear();
            encoder.encode(p as u64, &page.0, &mut out);
        }
    });
    let per_page = |d: Duration| (d.as_nanos() / PAGES as u128).clamp(1, u32::MAX as u128) as u32;
    Costs {
        first_write_ns: first_write.as_nanos().clamp(1, u32::MAX as u128) as u32,
        copy_ns: per_page(copy),
        hash_ns: per_page(hash),
        encode_ns: per_page(encode),
        protect_ns: protect.map_or(0, |p| p.as_nanos().clamp(1, u32::MAX as u128) as u32),
        measured: true,
        last_passed: per_page(copy),
    }
}

/// The fastest of `TRIES` runs of `f`.
fn fastest(mut f: impl FnMut()) -> Duration {
    (0..TRIES)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed()
        })
        .min()
        .expect("at least one try")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measuring_gives_a_cost_for_every_step() {
        let c = host_costs(Duration::from_micros(5), None, encode::Diff::Lz4);
        assert!(c.measured);
        assert_eq!(c.first_write_ns, 5000);
        for (name, ns) in [("copy", c.copy_ns), ("hash", c.hash_ns), ("encode", c.encode_ns)] {
            // Between a cache line's copy and a millisecond a page.
            assert!((10..1_000_000).contains(&ns), "{name}: {ns} ns a page");
        }
    }

    #[test]
    fn a_switch_given_overrides_the_policy() {
        use predict::Mode::*;
        assert_eq!(predict_writes(Tuning::Auto, None, false), Adaptive);
        assert_eq!(predict_writes(Tuning::Auto, None, true), Off, "the ring excludes prediction");
        assert_eq!(predict_writes(Tuning::Auto, Some(Histase), true), Histase, "given: the pipeline judges the pair");
        assert_eq!(predict_writes(Tuning::Static, None, false), Off);
        assert_eq!(predict_writes(Tuning::Static, Some(Adaptive), false), Adaptive);
        assert_eq!(prefetch(Tuning::Auto, None), prefetch::Mode::Adaptive);
        assert_eq!(prefetch(Tuning::Static, None), prefetch::Mode::Off);
        assert_eq!(prefetch(Tuning::Static, Some(prefetch::Mode::On)), prefetch::Mode::On);
        assert_eq!(sync_pages(Tuning::Auto, None), Granularity::Adaptive);
        assert_eq!(sync_pages(Tuning::Static, None), Granularity::Whole);
        assert_eq!(sync_pages(Tuning::Auto, Some(Granularity::Whole)), Granularity::Whole);
        assert_eq!(fake_ack(Tuning::Auto, None), fakeack::Mode::Bulk);
        assert_eq!(fake_ack(Tuning::Static, None), fakeack::Mode::Off);
        assert_eq!(fake_ack(Tuning::Auto, Some(fakeack::Mode::Off)), fakeack::Mode::Off);
        assert_eq!(fake_ack(Tuning::Static, Some(fakeack::Mode::On)), fakeack::Mode::On);
        assert_eq!(costs(Tuning::Static, encode::Diff::Lz4), Costs::default());
        let cheap = Costs { protect_ns: 100, copy_ns: 1000, measured: true, ..Costs::default() };
        assert_eq!(capture(Tuning::Auto, None, &cheap), capture::Mode::Cow);
        assert_eq!(capture(Tuning::Static, None, &cheap), capture::Mode::Pause);
        assert_eq!(capture(Tuning::Auto, None, &Costs { protect_ns: 900, ..cheap }), capture::Mode::Pause);
        assert_eq!(capture(Tuning::Auto, Some(capture::Mode::Pause), &cheap), capture::Mode::Pause);
        assert_eq!(diff(Tuning::Auto, None), encode::Diff::Lz4);
        assert_eq!(diff(Tuning::Static, None), encode::Diff::Lz4);
        assert_eq!(diff(Tuning::Auto, Some(encode::Diff::Auto)), encode::Diff::Auto);
        assert_eq!(diff(Tuning::Auto, Some(encode::Diff::Lz4)), encode::Diff::Lz4);
    }
}
