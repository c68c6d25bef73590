//! Incremental RESP2 request parser: multibulk arrays of bulk strings and
//! inline commands.
//!
//! The parser never copies multibulk arguments: it records their ranges
//! relative to the start of the command, so the bytes can stay in whichever
//! buffer they arrived in (the caller's input or the connection's backlog) and
//! the backlog can be compacted without invalidating them. Progress through a
//! partially received command is kept, so feeding a large command in many
//! small pieces costs linear, not quadratic, time.

use alloc::vec::Vec;

use crate::num::parse_i64;

/// Largest bulk string accepted (Redis allows 512 MiB; the guest's memory
/// is much smaller than that).
pub const MAX_BULK_LEN: usize = 64 << 20;
/// Most arguments in one multibulk request.
pub const MAX_ARGS: usize = 1 << 20;
/// Longest inline request or multibulk/bulk header line (Redis's limit).
pub const MAX_INLINE_LEN: usize = 64 << 10;
/// Most bytes one request may span; bounds a connection's backlog.
pub const MAX_REQUEST_LEN: usize = 128 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtoError {
    InvalidMultibulkLength,
    InvalidBulkLength,
    ExpectedDollar(u8),
    TooBigMbulkCount,
    TooBigBulkCount,
    TooBigInline,
    TooBigRequest,
    UnbalancedQuotes,
    MissingCrlf,
}

impl ProtoError {
    /// The text after "ERR Protocol error: ", worded as Redis words it.
    pub fn write(self, out: &mut Vec<u8>) {
        let msg: &[u8] = match self {
            ProtoError::InvalidMultibulkLength => b"invalid multibulk length",
            ProtoError::InvalidBulkLength => b"invalid bulk length",
            ProtoError::ExpectedDollar(c) => {
                out.extend_from_slice(b"expected '$', got '");
                out.push(if c == b'\r' || c == b'\n' { b' ' } else { c });
                b"'"
            }
            ProtoError::TooBigMbulkCount => b"too big mbulk count string",
            ProtoError::TooBigBulkCount => b"too big bulk count string",
            ProtoError::TooBigInline => b"too big inline request",
            ProtoError::TooBigRequest => b"too big request",
            ProtoError::UnbalancedQuotes => b"unbalanced quotes in request",
            ProtoError::MissingCrlf => b"expected CRLF",
        };
        out.extend_from_slice(msg);
    }
}

pub enum Step {
    /// More bytes are needed; the progress so far is kept.
    Incomplete,
    /// This many bytes held nothing to run (an empty line, `*0`).
    Skip(usize),
    /// A command spanning this many bytes; see [`Parser::args`].
    Command(usize),
    Error(ProtoError),
}

#[derive(Default)]
pub struct Parser {
    /// Arguments announced by the multibulk header; 0 before it is read.
    argc: usize,
    /// Where the next bulk header starts, relative to the command.
    cursor: usize,
    /// Where to resume looking for the end of the current line, so a long
    /// line trickling in is scanned once.
    scan: usize,
    ranges: Vec<(usize, usize)>,
    /// Inline arguments are unquoted into `scratch` rather than referenced.
    inline: bool,
    scratch: Vec<u8>,
}

/// The arguments of a parsed command.
#[derive(Clone, Copy)]
pub struct Args<'a> {
    base: &'a [u8],
    ranges: &'a [(usize, usize)],
}

impl<'a> Args<'a> {
    #[inline]
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    #[inline]
    pub fn get(&self, i: usize) -> &'a [u8] {
        let (s, e) = self.ranges[i];
        &self.base[s..e]
    }

    pub fn iter(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        let base = self.base;
        self.ranges.iter().map(move |&(s, e)| &base[s..e])
    }
}

enum Line {
    /// The line's content ends at the first index, the next line starts at
    /// the second.
    Found(usize, usize),
    Incomplete,
    TooLong,
    BadTerminator,
}

impl Parser {
    /// Parse the command at the start of `data`, which must hold the same
    /// leading bytes as on the previous call until a non-`Incomplete` step.
    pub fn next(&mut self, data: &[u8]) -> Step {
        match data.first() {
            None => Step::Incomplete,
            Some(b'*') => self.multibulk(data),
            Some(_) => self.inline(data),
        }
    }

    /// Arguments of the command last returned as `Step::Command`; `data` is
    /// the slice that was passed to `next`.
    pub fn args<'a>(&'a self, data: &'a [u8]) -> Args<'a> {
        let base = if self.inline { &self.scratch[..] } else { data };
        Args { base, ranges: &self.ranges }
    }

    /// Forget the finished command. Capacity is kept for the next one unless
    /// a rare huge request inflated it.
    pub fn reset(&mut self) {
        self.argc = 0;
        self.cursor = 0;
        self.scan = 0;
        self.inline = false;
        self.ranges.clear();
        if self.ranges.capacity() > 4096 {
            self.ranges.shrink_to(64);
        }
        self.scratch.clear();
    }

    /// A CRLF-terminated line starting at `from`.
    fn line(&mut self, data: &[u8], from: usize) -> Line {
        let start = self.scan.max(from);
        match data[start..].iter().position(|&c| c == b'\r') {
            Some(i) => {
                let cr = start + i;
                match data.get(cr + 1) {
                    None => {
                        self.scan = cr;
                        Line::Incomplete
                    }
                    Some(b'\n') => {
                        self.scan = 0;
                        Line::Found(cr, cr + 2)
                    }
                    Some(_) => Line::BadTerminator,
                }
            }
            None if data.len() - from > MAX_INLINE_LEN => Line::TooLong,
            None => {
                self.scan = data.len();
                Line::Incomplete
            }
        }
    }

    fn multibulk(&mut self, data: &[u8]) -> Step {
        if self.argc == 0 {
            let (end, next) = match self.line(data, 1) {
                Line::Found(end, next) => (end, next),
                Line::Incomplete => return Step::Incomplete,
                Line::TooLong => return Step::Error(ProtoError::TooBigMbulkCount),
                Line::BadTerminator => return Step::Error(ProtoError::MissingCrlf),
            };
            let n = match parse_i64(&data[1..end]) {
                Some(n) if n <= MAX_ARGS as i64 => n,
                _ => return Step::Error(ProtoError::InvalidMultibulkLength),
            };
            if n <= 0 {
                return Step::Skip(next);
            }
            self.argc = n as usize;
            self.cursor = next;
            self.inline = false;
            self.ranges.clear();
            // Reserve for what is likely, not what is announced: a header
            // alone must not make us allocate megabytes.
            self.ranges.reserve(self.argc.min(64));
        }
        while self.ranges.len() < self.argc {
            let c = self.cursor;
            match data.get(c) {
                None => return Step::Incomplete,
                Some(b'$') => {}
                Some(&other) => return Step::Error(ProtoError::ExpectedDollar(other)),
            }
            let (end, start) = match self.line(data, c + 1) {
                Line::Found(end, next) => (end, next),
                Line::Incomplete => return Step::Incomplete,
                Line::TooLong => return Step::Error(ProtoError::TooBigBulkCount),
                Line::BadTerminator => return Step::Error(ProtoError::MissingCrlf),
            };
            let len = match parse_i64(&data[c + 1..end]) {
                Some(n) if (0..=MAX_BULK_LEN as i64).contains(&n) => n as usize,
                _ => return Step::Error(ProtoError::InvalidBulkLength),
            };
            let stop = start + len;
            if stop + 2 > MAX_REQUEST_LEN {
                return Step::Error(ProtoError::TooBigRequest);
            }
            if data.len() < stop + 2 {
                return Step::Incomplete;
            }
            if &data[stop..stop + 2] != b"\r\n" {
                return Step::Error(ProtoError::MissingCrlf);
            }
            self.ranges.push((start, stop));
            self.cursor = stop + 2;
        }
        Step::Command(self.cursor)
    }

    fn inline(&mut self, data: &[u8]) -> Step {
        let from = self.scan;
        let nl = match data[from..].iter().position(|&c| c == b'\n') {
            Some(i) => from + i,
            None if data.len() > MAX_INLINE_LEN => return Step::Error(ProtoError::TooBigInline),
            None => {
                self.scan = data.len();
                return Step::Incomplete;
            }
        };
        self.scan = 0;
        let mut line = &data[..nl];
        if let [rest @ .., b'\r'] = line {
            line = rest;
        }
        self.inline = true;
        self.ranges.clear();
        self.scratch.clear();
        if split_args(line, &mut self.scratch, &mut self.ranges).is_err() {
            return Step::Error(ProtoError::UnbalancedQuotes);
        }
        if self.ranges.is_empty() {
            Step::Skip(nl + 1)
        } else {
            Step::Command(nl + 1)
        }
    }
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn is_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r' | b'\n' | 0x0b | 0x0c)
}

/// Redis's `sdssplitargs`: whitespace-separated words, with "double quotes"
/// (C escapes and \xHH inside) and 'single quotes' (only \' inside), which
/// may also start mid-word. A closing quote must be followed by whitespace or
/// the end of the line.
fn split_args(line: &[u8], out: &mut Vec<u8>, ranges: &mut Vec<(usize, usize)>) -> Result<(), ()> {
    #[derive(PartialEq)]
    enum Mode {
        Plain,
        Double,
        Single,
    }
    let n = line.len();
    let mut p = 0;
    loop {
        while p < n && is_space(line[p]) {
            p += 1;
        }
        if p == n {
            return Ok(());
        }
        let start = out.len();
        let mut mode = Mode::Plain;
        loop {
            let Some(&c) = line.get(p) else {
                if mode != Mode::Plain {
                    return Err(());
                }
                break;
            };
            match mode {
                Mode::Plain if is_space(c) => break,
                Mode::Plain if c == b'"' => mode = Mode::Double,
                Mode::Plain if c == b'\'' => mode = Mode::Single,
                Mode::Double if c == b'\\' && p + 3 < n && line[p + 1] == b'x' => match (hex(line[p + 2]), hex(line[p + 3])) {
                    (Some(h), Some(l)) => {
                        out.push(h << 4 | l);
                        p += 3;
                    }
                    _ => {
                        out.push(b'x');
                        p += 1;
                    }
                },
                Mode::Double if c == b'\\' && p + 1 < n => {
                    p += 1;
                    out.push(match line[p] {
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'b' => 0x08,
                        b'a' => 0x07,
                        e => e,
                    });
                }
                Mode::Single if c == b'\\' && line.get(p + 1) == Some(&b'\'') => {
                    p += 1;
                    out.push(b'\'');
                }
                Mode::Double | Mode::Single if c == if mode == Mode::Double { b'"' } else { b'\'' } => {
                    if p + 1 < n && !is_space(line[p + 1]) {
                        return Err(());
                    }
                    p += 1;
                    break;
                }
                _ => out.push(c),
            }
            p += 1;
        }
        ranges.push((start, out.len()));
    }
}
