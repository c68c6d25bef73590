//! The control socket: one JSON request per line, one JSON response per line.

pub mod client;
pub mod server;

use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Status,
    Pause,
    Resume,
    /// Pause, write a snapshot to `path`, then resume (or stop if `stop`).
    Snapshot {
        path: String,
        stop: bool,
    },
    /// Protect a running primary again with the backup at `backup`.
    Protect {
        backup: String,
    },
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication: Option<ftvm_replication::Status>,
}

impl Response {
    pub fn error(msg: impl Into<String>) -> Response {
        Response { ok: false, error: Some(msg.into()), ..Default::default() }
    }
}
