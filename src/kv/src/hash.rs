//! A fixed-seed hasher for the key table.
//!
//! hashbrown's default hasher seeds itself from a run-time source the guest
//! does not have, and a fixed seed keeps a run reproducible (same table
//! layout, same KEYS order) across the primary and a replayed backup. The
//! cost is no protection against chosen-collision floods, acceptable for a
//! guest-internal store.

use core::hash::{BuildHasher, Hasher};

const K0: u64 = 0x9e37_79b9_7f4a_7c15;
const K1: u64 = 0xa076_1d64_78bd_642f;
const K2: u64 = 0xe703_7ed1_a0b4_28db;

/// Multiply to 128 bits and fold the halves: every input bit reaches every
/// output bit in one step, which plain FxHash lacks (hashbrown takes its
/// control bits from the top of the hash).
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

#[derive(Clone, Copy, Default)]
pub struct FixedState;

impl BuildHasher for FixedState {
    type Hasher = KeyHasher;
    #[inline]
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher { state: K0 }
    }
}

pub struct KeyHasher {
    state: u64,
}

impl KeyHasher {
    #[inline(always)]
    fn mix(&mut self, word: u64) {
        self.state = fold(self.state ^ word, K1);
    }
}

impl Hasher for KeyHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.mix(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length byte keeps "a" and "a\0" apart.
            w[7] ^= rest.len() as u8;
            self.mix(u64::from_le_bytes(w) ^ K2);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        fold(self.state, K2)
    }
}
