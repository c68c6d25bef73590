//! The matrix's workloads and one measured run of each: memtouch over a
//! working set, a Redis-protocol server (the kv guest or redis-server on
//! the Linux personality) under redis-benchmark, and the bulk read. The
//! runs themselves are the ablation's and the sweep's (`runs`).

use std::path::Path;

use ftvm_testkit::topology::Topology;

use super::super::runs::{self, BoxError, EpochMeans, Replicated};
use super::super::Options;
use crate::redis_guest::App;

/// What `--cases` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// memtouch over --pages x --patterns x --vcpus.
    Memtouch,
    /// The kv guest under redis-benchmark, -P 1 and -P 16, values of --values bytes.
    Kv,
    /// redis-server (Linux personality) under redis-benchmark, as kv.
    Redis,
    /// GETs of one 4 MiB value from the kv guest.
    Bulk,
}

/// redis-benchmark's pipeline depths in the server cases.
pub const PIPELINES: [u32; 2] = [1, 16];
/// The unreplicated VM serves many times faster: this many times the
/// requests keep its run from being over in a few tens of milliseconds.
const REFERENCE_REQUESTS: u64 = 10;

/// One workload of the matrix (each measured at every epoch length).
#[derive(Clone, Debug, PartialEq)]
pub enum Workload {
    Memtouch { pages: u64, pattern: String, vcpus: u32 },
    Server { app: App, pipeline: u32, value: u32 },
    Bulk,
}

impl Workload {
    /// Every workload `--cases` selects, in the order given.
    pub fn selected(opts: &Options) -> Vec<Workload> {
        let mut out = Vec::new();
        for kind in &opts.cases {
            match kind {
                Kind::Memtouch => {
                    for &pages in &opts.pages {
                        for pattern in &opts.patterns {
                            for &vcpus in &opts.vcpus {
                                out.push(Workload::Memtouch { pages, pattern: pattern.clone(), vcpus });
                            }
                        }
                    }
                }
                Kind::Kv | Kind::Redis => {
                    let app = if *kind == Kind::Kv { App::Kv } else { App::Redis };
                    for pipeline in PIPELINES {
                        for &value in &opts.values {
                            out.push(Workload::Server { app, pipeline, value });
                        }
                    }
                }
                Kind::Bulk => out.push(Workload::Bulk),
            }
        }
        out
    }

    pub fn name(&self, opts: &Options) -> String {
        match self {
            Workload::Memtouch { pages, pattern, vcpus } => match opts.write_rate {
                0 => format!("{pages} pages {pattern}, {vcpus} vCPU"),
                rate => format!("{pages} pages {pattern} at {rate} writes/s, {vcpus} vCPU"),
            },
            Workload::Server { app, pipeline, value } => format!("{} -P {pipeline} -d {value}", app.name()),
            Workload::Bulk => format!("bulk read GET {} MiB x{}", runs::BULK_BYTES >> 20, opts.bulk_reads),
        }
    }

    pub fn needs_network(&self) -> bool {
        !matches!(self, Workload::Memtouch { .. })
    }

    /// The guest images this workload needs, checked before the first run.
    pub fn check_image(&self) -> Result<(), BoxError> {
        if let Workload::Server { app, .. } = self {
            app.existing_image(&crate::paths::images())?;
        }
        Ok(())
    }
}

/// One run's figures: (name, value, unit).
pub type Figures = Vec<(String, f64, &'static str)>;

/// Where the network runs happen and leave their files.
pub struct Place<'a> {
    pub topo: Option<&'a Topology>,
    pub scratch: &'a Path,
}

/// Run `w` once, unreplicated or replicated (`ft`): its figures, and the
/// per-epoch means when replicated.
pub fn measure(w: &Workload, ft: Option<Replicated>, opts: &Options, at: &Place) -> Result<(Figures, Option<EpochMeans>), BoxError> {
    let metrics = at.scratch.join("matrix.jsonl");
    let topo = || at.topo.ok_or("a network case needs the topology");
    match w {
        Workload::Memtouch { pages, pattern, vcpus } => {
            let mut cmdline = format!("ws={}K pattern={pattern} duration={}s report=0", pages * 4, opts.seconds);
            if opts.write_rate > 0 {
                // The hot set moves every half second (`shift` counts one
                // writer's writes; the rate is all of theirs).
                let shift = match pattern.as_str() {
                    "hotcold" => format!(" shift={}", (opts.write_rate / 2 / u64::from(*vcpus)).max(1)),
                    _ => String::new(),
                };
                cmdline += &format!(" rate={}{shift}", opts.write_rate);
            }
            let (rate, m) = runs::memtouch_on(*vcpus, &cmdline, ft, at.scratch)?;
            Ok((vec![("writes/s".into(), rate, "writes/s")], m))
        }
        Workload::Server { app, pipeline, value } => {
            let topo = topo()?;
            // Deeper pipelines serve as many times faster: as many times
            // the requests keep their runs seconds long.
            let requests = opts.requests * u64::from(*pipeline) * if ft.is_some() { 1 } else { REFERENCE_REQUESTS };
            let results = {
                let _vm = runs::start_server(topo, *app, ft, at.scratch, "matrix", &metrics)?;
                runs::redis_benchmark(topo, *pipeline, requests, *value)?
            };
            let mut figures = Vec::new();
            for b in results {
                figures.push((format!("{} requests/s", b.test), b.rps, "req/s"));
                figures.push((format!("{} p50", b.test), b.p50_ms, "ms"));
                figures.push((format!("{} p99", b.test), b.p99_ms, "ms"));
            }
            Ok((figures, ft.map(|_| runs::epoch_means(&metrics))))
        }
        Workload::Bulk => {
            let topo = topo()?;
            let rate = {
                let _vm = runs::start_server(topo, App::Kv, ft, at.scratch, "matrix", &metrics)?;
                runs::bulk_read(topo, opts.bulk_reads)?
            };
            Ok((vec![("read".into(), rate, "MB/s")], ft.map(|_| runs::epoch_means(&metrics))))
        }
    }
}
