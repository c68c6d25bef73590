//! The calibration at start, on real KVM: a tracked first write costs more
//! than an untracked one, and both are figures a host can produce.

use ftvm_vmm::calibrate::{self, CalibrationError, DEFAULT_PAGES};

#[test]
fn tracked_first_write_costs_more_than_an_untracked_write() {
    let cost = calibrate::tracked_first_write(DEFAULT_PAGES).unwrap();
    eprintln!("{cost:?}");
    assert_eq!((cost.pages, cost.rounds), (DEFAULT_PAGES, calibrate::ROUNDS));
    assert!(cost.tracked_ns > cost.untracked_ns, "{cost:?}");
    assert!((100.0..1_000_000.0).contains(&cost.tracked_ns), "tracked write between 0.1 µs and 1 ms: {cost:?}");
    assert!(cost.untracked_ns > 0.0 && cost.untracked_ns < 100_000.0, "{cost:?}");
    assert!(cost.tracking_ns() > 0.0);
}

#[test]
fn a_bad_page_count_is_refused() {
    for pages in [0, calibrate::MAX_PAGES + 1] {
        let err = calibrate::tracked_first_write(pages).unwrap_err();
        assert!(matches!(err, CalibrationError::BadPageCount(p) if p == pages), "{err}");
    }
}
