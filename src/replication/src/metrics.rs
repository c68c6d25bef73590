//! Per-epoch figures: logged as JSON lines on request, shown by `ftvm status`.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use ftvm_vmm::sync::Lock;

pub use crate::figures::{AppliedEpoch, EpochMetrics, StartedBy};
pub use crate::role::Role;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub role: Role,
    /// Last epoch checkpointed (primary) or applied (backup).
    pub epoch: u64,
    pub protected: bool,
    /// A one-line description of the replication state.
    pub detail: String,
    pub last: Option<EpochMetrics>,
    /// Acknowledged checkpoints so far, by what started them (a primary).
    #[serde(default)]
    pub started_by: StartedBy,
    /// The other side: a primary's backup, a backup's primary (empty when none).
    #[serde(default)]
    pub peer: String,
    /// Where a backup, once it took over, looks for its own backup, in order
    /// (`ftvm backup --standby`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub standbys: Vec<String>,
    /// Consensus-ordered replicas: the consensus term this replica knows.
    #[serde(default)]
    pub term: u64,
    /// Consensus-ordered replicas: the last `syncvm`'s figures.
    #[serde(default)]
    pub last_sync: Option<crate::consensus_status::SyncMetrics>,
    /// Consensus-ordered replicas: what started the election that made
    /// this replica leader (the last one it won).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub election: Option<crate::consensus_status::Election>,
    /// The per-page costs the adaptive mechanisms weigh (a primary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub costs: Option<crate::pipeline::costs::Costs>,
}

/// Shared, updated by the replication threads, read by the control socket.
#[derive(Clone, Default)]
pub struct StatusCell(Arc<Mutex<Status>>);

impl StatusCell {
    pub fn new(role: Role) -> StatusCell {
        StatusCell(Arc::new(Mutex::new(Status { role, ..Status::default() })))
    }

    pub fn lock(&self) -> MutexGuard<'_, Status> {
        self.0.locked()
    }

    pub fn get(&self) -> Status {
        self.lock().clone()
    }
}

/// `--metrics` and its options: where the JSON lines go and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsFile {
    pub path: PathBuf,
    /// One line per record (`--metrics-every-epoch`) instead of one per
    /// second summarising that second's records.
    pub every_epoch: bool,
    /// Rotate at this size: the file becomes `PATH.1` (replacing the one
    /// before) and a new `PATH` starts (`--metrics-max-bytes`; 0: never).
    pub max_bytes: u64,
}

/// `--metrics-max-bytes` unless given: 64 MiB.
pub const DEFAULT_METRICS_MAX_BYTES: u64 = 64 << 20;

impl MetricsFile {
    /// One line per record, rotated at the default size.
    pub fn every_epoch(path: PathBuf) -> MetricsFile {
        MetricsFile { path, every_epoch: true, max_bytes: DEFAULT_METRICS_MAX_BYTES }
    }
}

/// Metrics lines lost to write errors (a full disk, say) so far, in all of
/// this process's metrics files: the Prometheus counter's value.
pub fn write_errors() -> u64 {
    crate::telemetry::telemetry().metrics_write_errors()
}

/// JSON-lines sink for epoch metrics: written as they come
/// (`every_epoch`) or summed per second, rotated by size. A write that
/// fails loses its line, is counted ([`write_errors`]) and warned about
/// once per streak of the same error; the VM goes on. A thread of its own
/// writes the file (started by `open`, with its opener's seccomp filter:
/// rotating opens and renames files), so a slow or full disk never delays
/// the thread that records (the primary's acknowledgement reader).
pub struct MetricsLog(Option<Writer>);

struct Writer {
    tx: Mutex<Option<std::sync::mpsc::Sender<serde_json::Value>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Sink {
    path: PathBuf,
    file: File,
    /// Bytes in `file` (what decides rotation).
    size: u64,
    every_epoch: bool,
    max_bytes: u64,
    /// The second being summed (per-second lines).
    second: Option<Summary>,
    /// The kind of the last write error, while writes fail.
    failing: Option<std::io::ErrorKind>,
    /// Lines lost in the current streak of failures.
    lost: u64,
}

/// One second's records summed: the line written for it.
#[derive(Debug, Default, Serialize)]
struct Summary {
    /// Unix time of the second, in seconds.
    second: u64,
    /// Records (epochs, applied checkpoints) in it.
    count: u64,
    /// The first and last record's `epoch`.
    #[serde(skip_serializing_if = "Option::is_none")]
    first_epoch: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_epoch: Option<u64>,
    /// Every other number of the records, summed, and its largest value.
    sum: serde_json::Map<String, serde_json::Value>,
    max: serde_json::Map<String, serde_json::Value>,
    /// Text fields (`trigger`): how many records had each value.
    #[serde(flatten)]
    counts: serde_json::Map<String, serde_json::Value>,
}

impl Summary {
    fn add(&mut self, record: &serde_json::Value) {
        self.count += 1;
        let Some(fields) = record.as_object() else { return };
        for (k, v) in fields {
            match v {
                serde_json::Value::Number(n) if k == "epoch" => {
                    let e = n.as_u64().unwrap_or(0);
                    self.first_epoch.get_or_insert(e);
                    self.last_epoch = Some(e);
                }
                serde_json::Value::Number(n) => {
                    let n = n.as_u64().unwrap_or(0);
                    let max = self.max.entry(k.clone()).or_insert(0u64.into());
                    *max = (max.as_u64().unwrap_or(0).max(n)).into();
                    // A point in time (the backup's `guest_ns`,
                    // `applied_unix_ns`) has a latest, not a sum.
                    if k == "guest_ns" || k.ends_with("unix_ns") {
                        continue;
                    }
                    let sum = self.sum.entry(k.clone()).or_insert(0u64.into());
                    *sum = (sum.as_u64().unwrap_or(0).saturating_add(n)).into();
                }
                serde_json::Value::String(text) => {
                    let by = self.counts.entry(k.clone()).or_insert(serde_json::Value::Object(Default::default()));
                    if let Some(by) = by.as_object_mut() {
                        let n = by.entry(text.clone()).or_insert(0u64.into());
                        *n = (n.as_u64().unwrap_or(0) + 1).into();
                    }
                }
                _ => {}
            }
        }
    }
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Sink {
    fn write_line(&mut self, line: &str) {
        if self.max_bytes > 0 && self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
            self.rotate();
        }
        match self.file.write_all(line.as_bytes()) {
            Ok(()) => {
                self.size += line.len() as u64;
                if let Some(kind) = self.failing.take() {
                    tracing::warn!(path = %self.path.display(), lost = self.lost, "metrics file writable again after {kind}");
                    self.lost = 0;
                }
            }
            Err(e) => {
                crate::telemetry::telemetry().metrics_write_failed();
                self.lost += 1;
                if self.failing != Some(e.kind()) {
                    tracing::warn!(
                        path = %self.path.display(),
                        "cannot write metrics: {e}; lines are dropped (and counted) while this lasts, the VM goes on"
                    );
                    self.failing = Some(e.kind());
                }
            }
        }
    }

    /// `PATH` becomes `PATH.1` (the one before is gone) and a new `PATH` starts.
    fn rotate(&mut self) {
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        let reopened = std::fs::rename(&self.path, &old).and_then(|()| create_private(&self.path));
        match reopened {
            Ok(f) => {
                self.file = f;
                self.size = 0;
            }
            Err(e) => {
                // Writes go on into the old file (if it is still there).
                if self.failing.is_none() {
                    tracing::warn!(path = %self.path.display(), "cannot rotate the metrics file: {e}");
                }
                self.size = 0;
            }
        }
    }

    fn record(&mut self, record: serde_json::Value) {
        if self.every_epoch {
            let mut line = record.to_string();
            line.push('\n');
            self.write_line(&line);
            return;
        }
        let now = unix_seconds();
        if self.second.as_ref().is_some_and(|s| s.second != now) {
            self.flush();
        }
        self.second.get_or_insert_with(|| Summary { second: now, ..Summary::default() }).add(&record);
    }

    /// Write the second being summed.
    fn flush(&mut self) {
        if let Some(summary) = self.second.take() {
            let mut line = serde_json::to_string(&summary).expect("metrics serialize");
            line.push('\n');
            self.write_line(&line);
        }
    }
}

/// Create (or truncate) `path` for writing; a new file is its owner's
/// alone (mode 0600, whatever the umask): the figures say what the guest
/// does, and when, which is nobody else's business.
fn create_private(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)
}

impl MetricsLog {
    /// The errors name the file.
    pub fn open(file: Option<&MetricsFile>) -> std::io::Result<MetricsLog> {
        let Some(m) = file else { return Ok(MetricsLog(None)) };
        let f = create_private(&m.path).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", m.path.display())))?;
        // Only a regular file is rotated (never a device such as /dev/null).
        let regular = f.metadata().is_ok_and(|md| md.is_file());
        let mut sink = Sink {
            path: m.path.clone(),
            file: f,
            size: 0,
            every_epoch: m.every_epoch,
            max_bytes: if regular { m.max_bytes } else { 0 },
            second: None,
            failing: None,
            lost: 0,
        };
        let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
        let thread = std::thread::Builder::new()
            .name("metrics-file".into())
            .spawn(move || {
                for record in rx {
                    sink.record(record);
                }
                sink.flush();
            })
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: cannot start its writer: {e}", m.path.display())))?;
        Ok(MetricsLog(Some(Writer { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)) })))
    }

    pub fn record(&self, m: &impl Serialize) {
        if let Some(w) = &self.0 {
            let value = serde_json::to_value(m).expect("metrics serialize");
            if let Some(tx) = w.tx.locked().as_ref() {
                let _ = tx.send(value);
            }
        }
    }

    /// Write everything recorded so far (the last second's line too) and
    /// stop writing.
    pub fn close(&self) {
        if let Some(w) = &self.0 {
            drop(w.tx.locked().take());
            if let Some(t) = w.thread.locked().take() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for MetricsLog {
    fn drop(&mut self) {
        self.close();
    }
}
