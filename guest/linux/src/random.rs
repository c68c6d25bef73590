//! Random bytes for AT_RANDOM, getrandom and /dev/urandom: xoshiro256**
//! seeded from `rdrand` where the CPU has it, else from the TSC. Good
//! enough for hash seeds and run ids; not a cryptographic generator.

use core::arch::x86_64::{__cpuid, _rdrand64_step, _rdtsc};

use spin::Mutex;

static STATE: Mutex<Option<[u64; 4]>> = Mutex::new(None);

fn seed_word(i: u64) -> u64 {
    let has_rdrand = __cpuid(1).ecx & (1 << 30) != 0;
    if has_rdrand {
        let mut v = 0;
        for _ in 0..10 {
            // SAFETY: the CPU reported rdrand above.
            if unsafe { _rdrand64_step(&mut v) } == 1 {
                return v;
            }
        }
    }
    // SAFETY: rdtsc is allowed at CPL3 (ABI).
    splitmix(unsafe { _rdtsc() } ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn next(s: &mut [u64; 4]) -> u64 {
    let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
    let t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = s[3].rotate_left(45);
    result
}

pub fn fill(buf: &mut [u8]) {
    let mut g = STATE.lock();
    let s = g.get_or_insert_with(|| [seed_word(0), seed_word(1), seed_word(2), seed_word(3) | 1]);
    for chunk in buf.chunks_mut(8) {
        let v = next(s).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}
