//! RESP framing: pipelining, requests split anywhere, inline commands,
//! protocol errors and the limits that bound a connection's memory.

mod common;
use common::{resp, H};
use ftvm_kv::{Flow, MAX_BULK_LEN, MAX_INLINE_LEN};

fn pipeline(n: usize) -> (Vec<u8>, String) {
    let mut input = Vec::new();
    let mut expect = String::new();
    for i in 0..n {
        let k = format!("key:{i}");
        let v = format!("value-{}", "x".repeat(i % 37));
        input.extend(resp(&[b"SET", k.as_bytes(), v.as_bytes()]));
        input.extend(resp(&[b"GET", k.as_bytes()]));
        input.extend(resp(&[b"INCR", b"counter"]));
        expect += &format!("+OK\r\n${}\r\n{v}\r\n:{}\r\n", v.len(), i + 1);
    }
    (input, expect)
}

#[test]
fn many_commands_in_one_input() {
    let (input, expect) = pipeline(500);
    let mut h = H::new();
    let (out, flow) = h.feed(&input);
    assert_eq!(flow, Flow::Continue);
    assert_eq!(out, expect);
    assert_eq!(h.conn.buffered_len(), 0);
}

#[test]
fn split_at_every_byte() {
    let (input, expect) = pipeline(40);
    let mut h = H::new();
    let mut out = String::new();
    for b in input.chunks(1) {
        let (o, flow) = h.feed(b);
        assert_eq!(flow, Flow::Continue);
        out += &o;
    }
    assert_eq!(out, expect);
    assert_eq!(h.conn.buffered_len(), 0);
}

#[test]
fn split_at_every_chunk_size() {
    let (input, expect) = pipeline(60);
    for chunk in [2, 3, 7, 16, 100, 1000, 4096] {
        let mut h = H::new();
        let mut out = String::new();
        for b in input.chunks(chunk) {
            out += &h.feed(b).0;
        }
        assert_eq!(out, expect, "chunk {chunk}");
    }
}

#[test]
fn large_value_in_pieces() {
    let mut h = H::new();
    let value = vec![b'v'; 5 << 20];
    let input = resp(&[b"SET", b"big", &value]);
    for piece in input.chunks(64 << 10) {
        let (out, _) = h.feed(piece);
        assert!(out.is_empty() || out == "+OK\r\n");
    }
    assert_eq!(h.cmd("STRLEN big"), ":5242880\r\n");
    assert_eq!(h.conn.buffered_len(), 0);
}

#[test]
fn many_args_in_pieces() {
    // A huge MSET fed in small pieces must not be re-parsed from its start
    // each time (quadratic); this finishes quickly only if it is not.
    let mut args: Vec<Vec<u8>> = vec![b"MSET".to_vec()];
    for i in 0..100_000 {
        args.push(format!("k{i}").into_bytes());
        args.push(b"v".to_vec());
    }
    let refs: Vec<&[u8]> = args.iter().map(|a| &a[..]).collect();
    let input = resp(&refs);
    let mut h = H::new();
    let mut out = String::new();
    for piece in input.chunks(100) {
        out += &h.feed(piece).0;
    }
    assert_eq!(out, "+OK\r\n");
    assert_eq!(h.srv.dbsize(), 100_000);
}

#[test]
fn inline_commands() {
    let mut h = H::new();
    assert_eq!(h.feed(b"PING\r\n").0, "+PONG\r\n");
    assert_eq!(h.feed(b"ping\n").0, "+PONG\r\n");
    assert_eq!(h.feed(b"SET  a   b\r\nGET a\r\n").0, "+OK\r\n$1\r\nb\r\n");
    assert_eq!(h.feed(b"\r\n\n   \r\n").0, "");
    assert_eq!(h.feed(b"SET q \"x y\\n\\x41\"\r\nGET q\r\n").0, "+OK\r\n$5\r\nx y\nA\r\n");
    assert_eq!(h.feed(b"SET q 'it\\'s'\r\nGET q\r\n").0, "+OK\r\n$4\r\nit's\r\n");
    assert_eq!(h.feed(b"SET q \"\"\r\nSTRLEN q\r\n").0, "+OK\r\n:0\r\n");
    // Split inline line, then mixed with RESP.
    assert_eq!(h.feed(b"GE").0, "");
    assert_eq!(h.feed(b"T a").0, "");
    let mut rest = b"\r\n".to_vec();
    rest.extend(resp(&[b"GET", b"a"]));
    assert_eq!(h.feed(&rest).0, "$1\r\nb\r\n$1\r\nb\r\n");
    let (out, flow) = h.feed(b"SET a \"unterminated\r\n");
    assert_eq!(out, "-ERR Protocol error: unbalanced quotes in request\r\n");
    assert_eq!(flow, Flow::Close);
    let mut h = H::new();
    let (out, flow) = h.feed(b"SET a \"b\"c\r\n");
    assert_eq!((out.as_str(), flow), ("-ERR Protocol error: unbalanced quotes in request\r\n", Flow::Close));
}

fn error_closes(input: &[u8], msg: &str) {
    let mut h = H::new();
    let (out, flow) = h.feed(input);
    assert_eq!(out, format!("+PONG\r\n-ERR Protocol error: {msg}\r\n"), "{:?}", String::from_utf8_lossy(input));
    assert_eq!(flow, Flow::Close);
    assert_eq!(h.conn.buffered_len(), 0);
    assert_eq!(h.feed(b"PING\r\n"), (String::new(), Flow::Close));
}

#[test]
fn protocol_errors_reply_then_close() {
    let with_ping = |rest: &[u8]| [b"PING\r\n".as_slice(), rest].concat();
    error_closes(&with_ping(b"*abc\r\n"), "invalid multibulk length");
    error_closes(&with_ping(b"*2000000\r\n"), "invalid multibulk length");
    error_closes(&with_ping(b"*1\r\n$-1\r\n"), "invalid bulk length");
    error_closes(&with_ping(b"*1\r\n$x\r\n"), "invalid bulk length");
    error_closes(&with_ping(b"*1\r\n$536870913\r\n"), "invalid bulk length");
    error_closes(&with_ping(format!("*1\r\n${}\r\n", MAX_BULK_LEN + 1).as_bytes()), "invalid bulk length");
    error_closes(&with_ping(b"*1\r\n+PING\r\n"), "expected '$', got '+'");
    error_closes(&with_ping(b"*1\r\n$4\r\nPINGxx"), "expected CRLF");
    error_closes(&with_ping(b"*1\rx"), "expected CRLF");
    error_closes(&with_ping(&vec![b'x'; MAX_INLINE_LEN + 1]), "too big inline request");
    error_closes(&with_ping(&[b"*".as_slice(), &vec![b'1'; MAX_INLINE_LEN + 1]].concat()), "too big mbulk count string");
    error_closes(&with_ping(&[b"*1\r\n$".as_slice(), &vec![b'1'; MAX_INLINE_LEN + 1]].concat()), "too big bulk count string");
    // Three 60 MiB arguments announced: refused before the data arrives.
    let mut big = b"*3\r\n".to_vec();
    for _ in 0..2 {
        big.extend(format!("${}\r\n", 60 << 20).as_bytes());
        big.extend(vec![b'x'; 60 << 20]);
        big.extend(b"\r\n");
    }
    big.extend(format!("${}\r\n", 60 << 20).as_bytes());
    error_closes(&with_ping(&big), "too big request");
}

#[test]
fn empty_and_null_arrays_are_skipped() {
    let mut h = H::new();
    assert_eq!(h.feed(b"*0\r\n*-1\r\n*1\r\n$4\r\nPING\r\n").0, "+PONG\r\n");
}

#[test]
fn error_inside_split_input() {
    let mut h = H::new();
    assert_eq!(h.feed(b"*1\r\n$4\r\nPI").0, "");
    let (out, flow) = h.feed(b"NG\r\n*x\r\n");
    assert_eq!(out, "+PONG\r\n-ERR Protocol error: invalid multibulk length\r\n");
    assert_eq!(flow, Flow::Close);
}

#[test]
fn incomplete_tail_waits_and_is_bounded() {
    let mut h = H::new();
    // A header promising a big bulk buffers only what actually arrived.
    let (out, flow) = h.feed(format!("*1\r\n${}\r\nabc", MAX_BULK_LEN).as_bytes());
    assert_eq!((out.as_str(), flow), ("", Flow::Continue));
    assert!(h.conn.buffered_len() < 64);
    // An inline line without newline waits, up to the inline limit.
    let mut h = H::new();
    for _ in 0..(MAX_INLINE_LEN / 1024) {
        assert_eq!(h.feed(&[b'a'; 1024]).1, Flow::Continue);
    }
    assert_eq!(h.feed(b"a").1, Flow::Close);
}
