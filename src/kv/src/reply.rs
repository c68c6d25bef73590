//! RESP2 reply encoding, appended straight into the caller's output buffer.

use alloc::vec::Vec;

use crate::num::{push_i64, push_u64};

pub fn ok(out: &mut Vec<u8>) {
    out.extend_from_slice(b"+OK\r\n");
}

pub fn simple(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'+');
    out.extend_from_slice(s);
    out.extend_from_slice(b"\r\n");
}

pub fn nil(out: &mut Vec<u8>) {
    out.extend_from_slice(b"$-1\r\n");
}

pub fn int(out: &mut Vec<u8>, n: i64) {
    out.push(b':');
    push_i64(out, n);
    out.extend_from_slice(b"\r\n");
}

pub fn array_len(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    push_u64(out, n as u64);
    out.extend_from_slice(b"\r\n");
}

/// A value too big for the memory left gets an error in its place (a
/// valid reply, in an array too), rather than an allocation failure,
/// which ends a guest.
pub fn bulk(out: &mut Vec<u8>, b: &[u8]) {
    // Room for the value, its length and three CRLFs.
    if out.try_reserve(b.len() + 32).is_err() {
        err(out, "OOM not enough memory for the reply");
        return;
    }
    out.push(b'$');
    push_u64(out, b.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(b);
    out.extend_from_slice(b"\r\n");
}

/// An error line from parts. CR and LF become spaces, as Redis does, since
/// they would end the line early and desynchronise the client; parts may
/// carry client-supplied bytes (an unknown command's name).
pub fn error(out: &mut Vec<u8>, parts: &[&[u8]]) {
    out.push(b'-');
    for part in parts {
        out.extend(part.iter().map(|&c| if c == b'\r' || c == b'\n' { b' ' } else { c }));
    }
    out.extend_from_slice(b"\r\n");
}

pub fn err(out: &mut Vec<u8>, msg: &str) {
    error(out, &[msg.as_bytes()]);
}
