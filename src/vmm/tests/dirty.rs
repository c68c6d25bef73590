//! Dirty tracking through real KVM: both backends report exactly the pages
//! the guest wrote, plus the pages the VMM wrote.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ftvm_vmm::{Console, DirtyBackend, PageBitmap, Vm, VmConfig, VmExit};
use vm_memory::{Bytes, GuestAddress};

fn image(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/images").join(format!("{name}.elf"));
    assert!(path.exists(), "guest image {} missing: run scripts/build-images.sh", path.display());
    path
}

fn field(text: &str, key: &str) -> u64 {
    let v = text.split_whitespace().find_map(|w| w.strip_prefix(key)).unwrap_or_else(|| panic!("no {key} in {text}"));
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
        None => v.parse().unwrap(),
    }
}

/// A VM with `backend` tracking dirty pages from before its first
/// instruction, running `cmdline` on `image`; and its console output.
fn start_tracked(backend: DirtyBackend, mem_size: u64, vcpus: u32, image_name: &str, cmdline: &str) -> (Vm, Arc<Mutex<Vec<u8>>>) {
    let (console, out) = Console::capture();
    let config = VmConfig { mem_size, vcpus, dirty_backend: backend, console, ..Default::default() };
    let vm = Vm::new(config).unwrap();
    vm.boot(&image(image_name), None, cmdline).unwrap();
    vm.start_dirty_tracking().unwrap();
    vm.start().unwrap();
    (vm, out)
}

/// Waits for the probe's dirty run to exit cleanly: the first page it wrote.
fn probe_base_page(vm: &Vm, out: &Mutex<Vec<u8>>, backend: DirtyBackend) -> u64 {
    assert_eq!(vm.wait(), VmExit::Exited(0), "{backend}");
    let text = String::from_utf8(out.lock().unwrap().clone()).unwrap();
    field(&text, "base=") / 4096
}

fn check_backend(backend: DirtyBackend) {
    // 20000 writes overflow a 16384-entry ring, so ring-full exits are
    // exercised too.
    let (stride, count) = (2u64, 20_000u64);
    let (vm, out) = start_tracked(backend, 256 << 20, 1, "probe", &format!("dirty={stride},{count}"));
    let base_page = probe_base_page(&vm, &out, backend);
    let pages = vm.ram().pages();

    let none = PageBitmap::new(pages);
    let mut dirty = PageBitmap::new(pages);
    vm.collect_dirty(&mut dirty, &none).unwrap();
    let region = base_page..base_page + stride * count;
    let in_region: Vec<u64> = dirty.pages().filter(|p| region.contains(p)).collect();
    let expected: Vec<u64> = (0..count).map(|i| base_page + i * stride).collect();
    assert_eq!(in_region.len(), expected.len(), "{backend}: dirty pages inside the written region");
    assert_eq!(in_region, expected, "{backend}");
    assert!(!dirty.is_set(pages - 1), "{backend}: the untouched top of RAM is clean");
    let outside = dirty.count() - in_region.len() as u64;
    assert!(outside < 64, "{backend}: only a handful of runtime pages (stack, console, statics) besides: {outside}");

    // With the guest stopped, the next collection sees exactly what the VMM
    // writes, and nothing the first collection already returned.
    let vmm_pages = [base_page + 1, base_page + 3, 40];
    for p in vmm_pages {
        vm.ram().memory().write_obj(0xfeu8, GuestAddress(p * 4096 + 17)).unwrap();
    }
    let mut again = PageBitmap::new(pages);
    vm.collect_dirty(&mut again, &none).unwrap();
    let mut want = vmm_pages.to_vec();
    want.sort();
    assert_eq!(again.pages().collect::<Vec<_>>(), want, "{backend}: VMM writes only");

    // Told apart: the VMM's writes come as the VMM's, the tracked ones as the guest's.
    vm.ram().memory().write_obj(0xfeu8, GuestAddress(41 * 4096)).unwrap();
    let (mut guest, mut vmm) = (PageBitmap::new(pages), PageBitmap::new(pages));
    vm.harvest_dirty_by(&mut guest, &mut vmm).unwrap();
    vm.rearm_dirty(&none).unwrap();
    assert_eq!(vmm.pages().collect::<Vec<_>>(), vec![41], "{backend}: the VMM's write");
    assert_eq!(guest.count(), 0, "{backend}: the guest is stopped");
}

/// Pages left writable at a collection stay reported by later ones (the
/// write-prediction hook), with the bitmap backend; the ring re-protects all.
#[test]
fn pages_left_writable_are_reported_again() {
    for backend in [DirtyBackend::Bitmap, DirtyBackend::Ring] {
        let (vm, out) = start_tracked(backend, 64 << 20, 1, "probe", "dirty=1,32");
        let base = probe_base_page(&vm, &out, backend);
        let pages = vm.ram().pages();
        let mut keep = PageBitmap::new(pages);
        keep.set(base);
        keep.set(base + 5);
        let mut first = PageBitmap::new(pages);
        vm.collect_dirty(&mut first, &keep).unwrap();
        assert!(first.is_set(base) && first.is_set(base + 5) && first.is_set(base + 6), "{backend}");
        let mut second = PageBitmap::new(pages);
        vm.collect_dirty(&mut second, &PageBitmap::new(pages)).unwrap();
        let want: Vec<u64> = match backend {
            DirtyBackend::Bitmap => vec![base, base + 5],
            DirtyBackend::Ring => vec![],
        };
        assert_eq!(second.pages().collect::<Vec<_>>(), want, "{backend}");
        let mut third = PageBitmap::new(pages);
        vm.collect_dirty(&mut third, &PageBitmap::new(pages)).unwrap();
        assert!(third.is_empty(), "{backend}: re-armed once no longer left writable");
    }
}

#[test]
fn bitmap_backend_reports_exactly_the_written_pages() {
    check_backend(DirtyBackend::Bitmap);
}

#[test]
fn ring_backend_reports_exactly_the_written_pages() {
    check_backend(DirtyBackend::Ring);
}

#[test]
fn tracking_rearms_between_collections_of_a_running_guest() {
    for backend in [DirtyBackend::Bitmap, DirtyBackend::Ring] {
        let (vm, _out) = start_tracked(backend, 64 << 20, 2, "memtouch", "ws=4M pattern=seq duration=3s report=0");
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut counts = Vec::new();
        for _ in 0..3 {
            vm.pause();
            let mut d = PageBitmap::new(vm.ram().pages());
            vm.collect_dirty(&mut d, &PageBitmap::new(vm.ram().pages())).unwrap();
            counts.push(d.count());
            vm.resume();
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        vm.request_stop();
        vm.wait();
        // memtouch sweeps its 1024-page set continuously, so every epoch
        // must see (at least) the whole set dirty again.
        assert!(counts.iter().all(|&c| c >= 1024), "{backend}: {counts:?}");
    }
}
