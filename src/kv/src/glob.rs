//! Redis's glob patterns (KEYS, CONFIG GET): `*`, `?`, `[abc]`, `[^a-z]`,
//! and `\` to escape.
//!
//! Matched with the single-backtrack-point algorithm rather than Redis's
//! recursion, so a pattern like `*a*a*a*a*b` costs O(pattern * string)
//! instead of exponential time.

pub fn matches(pat: &[u8], s: &[u8]) -> bool {
    let (mut p, mut i) = (0, 0);
    // Pattern position after the last star, and the string position it is
    // currently assumed to match up to.
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        if p < pat.len() {
            match pat[p] {
                b'*' => {
                    while p < pat.len() && pat[p] == b'*' {
                        p += 1;
                    }
                    if p == pat.len() {
                        return true;
                    }
                    star = Some((p, i));
                    continue;
                }
                b'?' => {
                    p += 1;
                    i += 1;
                    continue;
                }
                b'[' => {
                    let (hit, next) = class(pat, p + 1, s[i]);
                    if hit {
                        p = next;
                        i += 1;
                        continue;
                    }
                }
                b'\\' if p + 1 < pat.len() => {
                    if pat[p + 1] == s[i] {
                        p += 2;
                        i += 1;
                        continue;
                    }
                }
                c => {
                    if c == s[i] {
                        p += 1;
                        i += 1;
                        continue;
                    }
                }
            }
        }
        match star {
            Some((sp, si)) => {
                p = sp;
                i = si + 1;
                star = Some((sp, si + 1));
            }
            None => return false,
        }
    }
    pat[p..].iter().all(|&c| c == b'*')
}

/// Match `c` against the class whose body starts at `p` (just past `[`).
/// Returns whether it matched and where the pattern continues. An
/// unterminated class runs to the end of the pattern, as in Redis.
fn class(pat: &[u8], mut p: usize, c: u8) -> (bool, usize) {
    let negate = pat.get(p) == Some(&b'^');
    if negate {
        p += 1;
    }
    let mut hit = false;
    loop {
        match pat.get(p) {
            None => break,
            Some(b']') => {
                p += 1;
                break;
            }
            Some(b'\\') if p + 1 < pat.len() => {
                hit |= pat[p + 1] == c;
                p += 2;
            }
            Some(&lo) if p + 2 < pat.len() && pat[p + 1] == b'-' => {
                let hi = pat[p + 2];
                let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
                hit |= (lo..=hi).contains(&c);
                p += 3;
            }
            Some(&x) => {
                hit |= x == c;
                p += 1;
            }
        }
    }
    (hit != negate, p)
}
