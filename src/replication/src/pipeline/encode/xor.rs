//! The block compare of the diff encoder: XOR a page against the version
//! the backup has, 64 bytes at a time, and keep the XOR of every block that
//! differs. Three compare kernels give the same output: AVX-512 (one
//! register per block), AVX2 (two) and a portable one (eight 64-bit words);
//! the widest the CPU has is chosen at run time.

use ftvm_vmm::memory::PAGE;
use ftvm_vmm::pages::diff::{BLOCK, BLOCKS};

/// One way to compute a page's block diff that this CPU runs: only
/// `available` makes one, so a kernel in hand is safe to call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel(Isa);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// Eight 64-bit words per block; any x86-64 CPU.
    Scalar,
    /// Two 256-bit registers per block.
    Avx2,
    /// One 512-bit register per block.
    Avx512,
}

impl Kernel {
    /// The portable kernel.
    pub const SCALAR: Kernel = Kernel(Isa::Scalar);

    /// The fastest kernel this CPU runs.
    pub fn best() -> Kernel {
        *Kernel::available().last().expect("the scalar kernel runs everywhere")
    }

    /// Every kernel this CPU runs, slowest first.
    pub fn available() -> Vec<Kernel> {
        let mut all = vec![Kernel::SCALAR];
        if std::arch::is_x86_feature_detected!("avx2") {
            all.push(Kernel(Isa::Avx2));
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            all.push(Kernel(Isa::Avx512));
        }
        all
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Compare `new` with `old` block by block: bit `b` of the result is set
    /// when block `b` differs, and `out` starts with `old ^ new` of each such
    /// block, in page order (64 bytes times the number of bits set).
    ///
    /// Two passes: the compare reads both pages with nothing but the mask
    /// carried from block to block (a store per block at a position that
    /// depends on the blocks before it would chain them); then the few
    /// changed blocks, in L1 by then, are XORed out.
    pub fn diff(self, old: &[u8; PAGE], new: &[u8; PAGE], out: &mut [u8; PAGE]) -> u64 {
        let mask = match self.0 {
            Isa::Scalar => changed_scalar(old, new),
            // SAFETY: only `available` makes this kernel, after it found
            // AVX2 on this CPU.
            Isa::Avx2 => unsafe { changed_avx2(old, new) },
            // SAFETY: only `available` makes this kernel, after it found
            // AVX-512F on this CPU.
            Isa::Avx512 => unsafe { changed_avx512(old, new) },
        };
        let blocks = (0..BLOCKS).filter(|b| mask & 1 << b != 0);
        for (dst, b) in out.chunks_exact_mut(BLOCK).zip(blocks) {
            let range = b * BLOCK..(b + 1) * BLOCK;
            for ((d, o), n) in dst.iter_mut().zip(&old[range.clone()]).zip(&new[range]) {
                *d = o ^ n;
            }
        }
        mask
    }
}

/// The mask whose bit `b` says whether block `b` `differs`: the loop every
/// kernel shares, inlined into each so that its compare is the kernel's.
#[inline(always)]
fn block_mask(mut differs: impl FnMut(usize) -> bool) -> u64 {
    let mut mask = 0u64;
    for b in 0..BLOCKS {
        mask |= u64::from(differs(b)) << b;
    }
    mask
}

fn changed_scalar(old: &[u8; PAGE], new: &[u8; PAGE]) -> u64 {
    fn words(page: &[u8; PAGE], b: usize) -> impl Iterator<Item = u64> + '_ {
        page[b * BLOCK..(b + 1) * BLOCK].chunks_exact(8).map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
    }
    block_mask(|b| words(old, b).zip(words(new, b)).fold(0, |any, (o, n)| any | (o ^ n)) != 0)
}

#[target_feature(enable = "avx2")]
fn changed_avx2(old: &[u8; PAGE], new: &[u8; PAGE]) -> u64 {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_or_si256, _mm256_testz_si256, _mm256_xor_si256};
    let (o, n) = (old.as_ptr().cast::<__m256i>(), new.as_ptr().cast::<__m256i>());
    block_mask(|b| {
        // SAFETY: block `b` is bytes 64b..64b+64 of both pages (b < 64): two
        // unaligned 32-byte loads from each.
        unsafe {
            let lo = _mm256_xor_si256(_mm256_loadu_si256(o.add(2 * b)), _mm256_loadu_si256(n.add(2 * b)));
            let hi = _mm256_xor_si256(_mm256_loadu_si256(o.add(2 * b + 1)), _mm256_loadu_si256(n.add(2 * b + 1)));
            let both = _mm256_or_si256(lo, hi);
            _mm256_testz_si256(both, both) == 0
        }
    })
}

/// As `changed_avx2`, one 512-bit compare per block.
#[target_feature(enable = "avx512f")]
fn changed_avx512(old: &[u8; PAGE], new: &[u8; PAGE]) -> u64 {
    use std::arch::x86_64::{__m512i, _mm512_cmpneq_epi64_mask, _mm512_loadu_si512};
    let (o, n) = (old.as_ptr().cast::<__m512i>(), new.as_ptr().cast::<__m512i>());
    block_mask(|b| {
        // SAFETY: block `b` is bytes 64b..64b+64 of both pages (b < 64): one
        // unaligned 64-byte load from each.
        unsafe { _mm512_cmpneq_epi64_mask(_mm512_loadu_si512(o.add(b)), _mm512_loadu_si512(n.add(b))) != 0 }
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The definition, byte by byte.
    fn reference(old: &[u8; PAGE], new: &[u8; PAGE]) -> (u64, Vec<u8>) {
        let mut mask = 0;
        let mut out = Vec::new();
        for b in 0..BLOCKS {
            let x: Vec<u8> = (b * BLOCK..(b + 1) * BLOCK).map(|i| old[i] ^ new[i]).collect();
            if x.iter().any(|&v| v != 0) {
                mask |= 1 << b;
                out.extend(x);
            }
        }
        (mask, out)
    }

    /// xorshift64*: reproducible pages without a crate (the diff encoder's
    /// tests use it too).
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn page(&mut self) -> Page {
            let mut p = Box::new([0u8; PAGE]);
            p.iter_mut().for_each(|b| *b = self.next() as u8);
            p
        }
    }

    /// Pairs of pages (old, new) that stress the kernels: random, equal,
    /// all different, one bit flipped at every block edge, every other
    /// block, the first and last byte only, and random blocks changed.
    type Page = Box<[u8; PAGE]>;

    fn cases() -> Vec<(Page, Page)> {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut cases = Vec::new();
        for _ in 0..32 {
            cases.push((rng.page(), rng.page()));
        }
        let base = rng.page();
        cases.push((base.clone(), base.clone()));
        cases.push((Box::new([0; PAGE]), Box::new([0; PAGE])));
        cases.push((Box::new([0; PAGE]), Box::new([0xff; PAGE])));
        for at in [0, BLOCK - 1, BLOCK, PAGE / 2 - 1, PAGE / 2, PAGE - BLOCK, PAGE - 1] {
            let mut new = base.clone();
            new[at] ^= 0x80;
            cases.push((base.clone(), new));
        }
        let mut alternate = base.clone();
        alternate.chunks_exact_mut(BLOCK).step_by(2).for_each(|b| b[BLOCK / 2] ^= 1);
        cases.push((base.clone(), alternate));
        let mut ends = base.clone();
        ends[0] ^= 1;
        ends[PAGE - 1] ^= 1;
        cases.push((base.clone(), ends));
        for changed in [1, 2, 7, 31, 63, 64] {
            let mut new = base.clone();
            for _ in 0..changed {
                let i = rng.next() as usize % PAGE;
                new[i] = new[i].wrapping_add(1);
            }
            cases.push((base.clone(), new));
        }
        cases
    }

    #[test]
    fn every_kernel_gives_the_reference_output() {
        let kernels = Kernel::available();
        assert!(kernels.contains(&Kernel::SCALAR));
        for (i, (old, new)) in cases().iter().enumerate() {
            let (want_mask, want) = reference(old, new);
            for &k in &kernels {
                let mut out = Box::new([0xa5u8; PAGE]);
                let mask = k.diff(old, new, &mut out);
                assert_eq!(mask, want_mask, "case {i}, {}", k.name());
                assert_eq!(&out[..want.len()], &want[..], "case {i}, {}", k.name());
            }
        }
    }

    #[test]
    fn the_best_kernel_is_the_widest_the_cpu_has() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let want = if cpuinfo.contains(" avx512f") {
            "avx512"
        } else if cpuinfo.contains(" avx2") {
            "avx2"
        } else {
            "scalar"
        };
        assert_eq!(Kernel::best().name(), want);
        assert_eq!(Kernel::available().len(), 1 + cpuinfo.contains(" avx2") as usize + cpuinfo.contains(" avx512f") as usize);
    }
}
