//! The cost of securing the replication channel: checkpoint frames through
//! the real transports (TCP on loopback) in clear, authenticated
//! (`--secret-file`) and encrypted (`--encrypt`), measured in the same run;
//! ratios are against the channel in clear.
//!
//! Two figures per frame size: streaming throughput (frames back to back,
//! one acknowledgement at the end) and the round trip of one checkpoint
//! (send a frame, wait for its acknowledgement), which is what an epoch
//! waits for before it releases output.

use std::net::TcpListener;
use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ftvm_replication::pipeline::transport::{self, Auth, AuthTransport, Secret, Transport};
use ftvm_replication::protocol::{self, Kind, HANDSHAKE_LIMIT};

use crate::report::{self, Row};

type BoxError = Box<dyn std::error::Error>;
/// The receiving thread: Ok once the stream closed cleanly.
type Receiver = JoinHandle<Result<(), String>>;

#[derive(clap::Args)]
pub struct Options {
    /// Frame sizes in KiB.
    #[arg(long, value_delimiter = ',', default_value = "64,4096")]
    sizes_kib: Vec<usize>,
    /// MiB streamed per measurement.
    #[arg(long, default_value_t = 1024)]
    stream_mib: usize,
    /// Round trips per measurement.
    #[arg(long, default_value_t = 100)]
    round_trips: usize,
    /// Measurements per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Clear,
    Authenticated,
    Encrypted,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Clear => "clear",
            Mode::Authenticated => "authenticated",
            Mode::Encrypted => "encrypted",
        }
    }

    fn auth(self) -> Option<Auth> {
        let secret = Secret::from_bytes(b"ftvm-bench channel secret");
        match self {
            Mode::Clear => None,
            Mode::Authenticated => Some(Auth { secret, encrypt: false }),
            Mode::Encrypted => Some(Auth { secret, encrypt: true }),
        }
    }
}

/// The backup's end: receives frames and acknowledges every `Bye` (the
/// end of a batch) with an Ack; ends when the stream closes.
fn receiver(mode: Mode, listener: TcpListener, limit: u64) -> Receiver {
    std::thread::spawn(move || {
        let mut tcp = transport::accept(&listener).map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        let mut link: Box<dyn Transport> = match mode.auth() {
            None => Box::new(tcp),
            Some(auth) => {
                let first = tcp.recv(HANDSHAKE_LIMIT, &mut buf).map_err(|e| e.to_string())?;
                Box::new(AuthTransport::respond(tcp, first, &buf, &auth).map_err(|e| e.to_string())?)
            }
        };
        let mut batches = 0;
        loop {
            match link.recv(limit, &mut buf) {
                Ok(Kind::Bye) => {
                    link.send(&protocol::ack(batches)).map_err(|e| e.to_string())?;
                    batches += 1;
                }
                Ok(_) => {}
                Err(protocol::ProtocolError::Closed) => return Ok(()),
                Err(e) => return Err(e.to_string()),
            }
        }
    })
}

/// Connected ends for `mode`.
fn pair(mode: Mode, frame_len: usize) -> Result<(Box<dyn Transport>, Receiver), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let rx = receiver(mode, listener, frame_len as u64 + 64);
    let tcp = transport::connect(&addr, Duration::from_secs(5))?;
    let link: Box<dyn Transport> = match mode.auth() {
        None => Box::new(tcp),
        Some(auth) => Box::new(AuthTransport::initiate(tcp, &auth)?),
    };
    Ok((link, rx))
}

/// Send `frames` frames of `frame` and a Bye, wait for the Ack.
fn batch(link: &mut dyn Transport, frame: &[u8], frames: usize, bye: &[u8], buf: &mut Vec<u8>) -> Result<(), BoxError> {
    for _ in 0..frames {
        link.send(frame)?;
    }
    link.send(bye)?;
    match link.recv(64, buf)? {
        Kind::Ack => Ok(()),
        other => Err(format!("expected Ack, got {other:?}").into()),
    }
}

struct Measured {
    bytes_per_s: f64,
    round_trip_ms: f64,
}

fn measure(mode: Mode, frame_len: usize, opts: &Options) -> Result<Measured, BoxError> {
    // A checkpoint-like payload: not compressible, not zero.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let payload: Vec<u8> = (0..frame_len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect();
    let frame = protocol::frame(Kind::Checkpoint, &payload);
    let bye = protocol::message(Kind::Bye, &0i32);
    let (mut link, rx) = pair(mode, frame_len)?;
    let mut buf = Vec::new();
    // Warm up: buffers at their final size, TCP window open.
    batch(link.as_mut(), &frame, 8, &bye, &mut buf)?;
    let frames = ((opts.stream_mib << 20) / frame_len).max(1);
    let t0 = Instant::now();
    batch(link.as_mut(), &frame, frames, &bye, &mut buf)?;
    let bytes_per_s = (frames * frame.len()) as f64 / t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for _ in 0..opts.round_trips {
        batch(link.as_mut(), &frame, 1, &bye, &mut buf)?;
    }
    let round_trip_ms = t0.elapsed().as_secs_f64() * 1e3 / opts.round_trips as f64;
    link.shutdown();
    drop(link);
    rx.join().map_err(|_| "receiver panicked")?.map_err(|e| format!("receiver: {e}"))?;
    Ok(Measured { bytes_per_s, round_trip_ms })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(opts: &Options, out: &Path) -> Result<(), BoxError> {
    let mut rows = Vec::new();
    for &kib in &opts.sizes_kib {
        let frame_len = kib << 10;
        let group = format!("channel {kib} KiB frames");
        // Interleave the modes in every repetition so drift hits them alike.
        let modes = [Mode::Clear, Mode::Authenticated, Mode::Encrypted];
        let mut results: Vec<Vec<Measured>> = modes.iter().map(|_| Vec::new()).collect();
        for _ in 0..opts.repeat.max(1) {
            for (i, &mode) in modes.iter().enumerate() {
                results[i].push(measure(mode, frame_len, opts)?);
            }
        }
        let figures: Vec<(f64, f64)> = results
            .iter()
            .map(|r| (median(r.iter().map(|m| m.bytes_per_s / 1e6).collect()), median(r.iter().map(|m| m.round_trip_ms).collect())))
            .collect();
        let (clear_mbs, clear_rtt) = figures[0];
        for (&mode, &(mbs, rtt)) in modes.iter().zip(&figures) {
            let name = mode.name();
            rows.push(Row {
                group: group.clone(),
                case: format!("{name}: throughput"),
                value: mbs,
                unit: "MB/s",
                reference: Some(clear_mbs),
            });
            rows.push(Row {
                group: group.clone(),
                case: format!("{name}: checkpoint round trip"),
                value: rtt,
                unit: "ms",
                reference: Some(clear_rtt),
            });
        }
    }
    let bars = rows.iter().filter(|r| r.unit == "MB/s").map(|r| (format!("{} {}", r.group, r.case), r.value)).collect();
    report::publish(
        out,
        "channel",
        &rows,
        &report::BarChart {
            title: "replication channel: checkpoint frames in clear, authenticated, encrypted",
            category: "frame size; channel",
            quantity: "throughput (MB/s)",
            bars,
            reference: None,
        },
    )?;
    Ok(())
}
