//! Decimal integers as Redis reads and writes them, without `core::fmt`
//! (it is slow and this sits on every reply).

/// Redis's `string2ll`: optional '-', no '+', no leading zeros, no spaces,
/// must fit an i64. Being this strict matters: "01" or " 1" stored by SET must
/// make INCR fail exactly as it does on Redis.
pub fn parse_i64(s: &[u8]) -> Option<i64> {
    let (neg, digits) = match s {
        [] => return None,
        [b'0'] => return Some(0),
        [b'-', rest @ ..] => (true, rest),
        _ => (false, s),
    };
    match digits.first() {
        Some(b'1'..=b'9') => {}
        _ => return None,
    }
    if digits.len() > 19 {
        return None;
    }
    // Accumulate the magnitude as u64 so that i64::MIN parses.
    let mut v: u64 = 0;
    for &c in digits {
        if !c.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
    }
    if neg {
        if v > i64::MAX as u64 + 1 {
            None
        } else {
            Some((v as i64).wrapping_neg())
        }
    } else {
        i64::try_from(v).ok()
    }
}

/// Decimal digits of an integer, formatted on the stack (at most 20
/// bytes: u64::MAX and i64::MIN both fit).
pub struct Digits {
    buf: [u8; 20],
    start: usize,
}

impl Digits {
    pub fn u64(mut v: u64) -> Digits {
        let mut d = Digits { buf: [0; 20], start: 20 };
        loop {
            d.start -= 1;
            d.buf[d.start] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                return d;
            }
        }
    }

    pub fn i64(v: i64) -> Digits {
        let mut d = Digits::u64(v.unsigned_abs());
        if v < 0 {
            d.start -= 1;
            d.buf[d.start] = b'-';
        }
        d
    }

    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

pub fn push_u64(out: &mut alloc::vec::Vec<u8>, v: u64) {
    out.extend_from_slice(Digits::u64(v).as_bytes());
}

pub fn push_i64(out: &mut alloc::vec::Vec<u8>, v: i64) {
    out.extend_from_slice(Digits::i64(v).as_bytes());
}
