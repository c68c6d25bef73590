//! The arbiter: who owns a replicated VM's output, decided by one atomic
//! compare-and-swap in etcd (VMware FT's test-and-set on shared storage).
//!
//! The key `ftvm/<name>/owner` holds `{"generation": G, "owner": ID}`. A
//! side claims ownership by swapping in generation G+1 under the condition
//! that the key is still at the revision it last saw; of a primary and a
//! backup that both try after losing each other, exactly one wins. The
//! loser never emits again. Spoken over etcd's v3 JSON gateway (plain
//! HTTP, keys and values base64), about 2 ms per transaction on loopback.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One request to etcd gives up after this long.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(1000);

#[derive(Debug, thiserror::Error)]
pub enum ArbiterError {
    #[error("the arbiter at {endpoint} is unreachable: {err}")]
    Unreachable { endpoint: String, err: String },
    #[error("the arbiter at {endpoint} answered something unexpected: {what}")]
    Protocol { endpoint: String, what: String },
}

/// Who owns the VM, and the key's revision that a claim must match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    pub generation: u64,
    pub owner: String,
    /// etcd's mod_revision of the key; 0 when nobody ever owned the VM.
    pub revision: i64,
}

#[derive(Serialize, Deserialize)]
struct Record {
    generation: u64,
    owner: String,
}

/// The outcome of a claim.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// This side owns the VM now.
    Won(Ownership),
    /// Someone else changed ownership since `seen`: this is who owns it.
    Lost(Ownership),
}

/// A client for one VM's ownership key.
#[derive(Clone)]
pub struct Arbiter {
    endpoint: String,
    key: String,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Arbiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Arbiter({}, {})", self.endpoint, self.key)
    }
}

impl Arbiter {
    /// The arbiter at `endpoint` (`http://HOST:PORT`) for the VM called `name`.
    pub fn new(endpoint: &str, name: &str) -> Arbiter {
        let agent = ureq::Agent::config_builder().timeout_global(Some(REQUEST_TIMEOUT)).http_status_as_error(false).build().into();
        Arbiter { endpoint: endpoint.trim_end_matches('/').to_string(), key: format!("ftvm/{name}/owner"), agent }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn protocol(&self, what: impl Into<String>) -> ArbiterError {
        ArbiterError::Protocol { endpoint: self.endpoint.clone(), what: what.into() }
    }

    fn call(&self, path: &str, body: Value) -> Result<Value, ArbiterError> {
        let url = format!("{}{path}", self.endpoint);
        let unreachable = |err: String| ArbiterError::Unreachable { endpoint: self.endpoint.clone(), err };
        let mut response = self
            .agent
            .post(&url)
            .header("content-type", "application/json")
            .send(body.to_string())
            .map_err(|e| unreachable(e.to_string()))?;
        let status = response.status();
        let text = response.body_mut().read_to_string().map_err(|e| unreachable(e.to_string()))?;
        if !status.is_success() {
            return Err(self.protocol(format!("HTTP {status}: {}", text.trim())));
        }
        serde_json::from_str(&text).map_err(|e| self.protocol(format!("{e}: {text}")))
    }

    fn decode(&self, kv: &Value) -> Result<Ownership, ArbiterError> {
        let value = kv["value"].as_str().unwrap_or("");
        let bytes = B64.decode(value).map_err(|e| self.protocol(format!("value is not base64: {e}")))?;
        let record: Record = serde_json::from_slice(&bytes).map_err(|e| self.protocol(format!("value is not an ownership record: {e}")))?;
        let revision = kv["mod_revision"].as_str().and_then(|r| r.parse().ok()).ok_or_else(|| self.protocol("no mod_revision"))?;
        Ok(Ownership { generation: record.generation, owner: record.owner, revision })
    }

    /// The current owner; generation 0 and revision 0 when there is none.
    pub fn read(&self) -> Result<Ownership, ArbiterError> {
        let reply = self.call("/v3/kv/range", json!({ "key": B64.encode(&self.key) }))?;
        match reply["kvs"].as_array().and_then(|kvs| kvs.first()) {
            Some(kv) => self.decode(kv),
            None => Ok(Ownership { generation: 0, owner: String::new(), revision: 0 }),
        }
    }

    /// Become the owner as `me` (unique to this process: see `identity`),
    /// provided ownership is still as `seen`. Retrying after an error is
    /// safe: a claim of ours that did reach etcd counts as won.
    pub fn claim(&self, seen: &Ownership, me: &str) -> Result<Claim, ArbiterError> {
        let key = B64.encode(&self.key);
        let next = Record { generation: seen.generation + 1, owner: me.to_string() };
        let value = B64.encode(serde_json::to_vec(&next).expect("record serializes"));
        let compare = if seen.revision == 0 {
            json!({ "key": key, "target": "CREATE", "create_revision": "0" })
        } else {
            json!({ "key": key, "target": "MOD", "mod_revision": seen.revision.to_string() })
        };
        let reply = self.call(
            "/v3/kv/txn",
            json!({
                "compare": [compare],
                "success": [{ "request_put": { "key": key, "value": value } }],
                "failure": [{ "request_range": { "key": key } }],
            }),
        )?;
        if reply["succeeded"].as_bool() == Some(true) {
            let revision = reply["header"]["revision"].as_str().and_then(|r| r.parse().ok()).ok_or_else(|| self.protocol("no revision"))?;
            return Ok(Claim::Won(Ownership { generation: next.generation, owner: next.owner, revision }));
        }
        let current = reply["responses"][0]["response_range"]["kvs"][0].clone();
        if current.is_null() {
            return Ok(Claim::Lost(Ownership { generation: 0, owner: String::new(), revision: 0 }));
        }
        let current = self.decode(&current)?;
        // A retry after a request that timed out on our side but reached
        // etcd: the earlier attempt won, and it was ours.
        if current.owner == me && current.generation == next.generation {
            return Ok(Claim::Won(current));
        }
        Ok(Claim::Lost(current))
    }
}
