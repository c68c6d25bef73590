//! A small etcd v3 client over etcd's JSON gateway (plain HTTP, keys and
//! values base64, 64-bit numbers as strings): reads of a key or a prefix,
//! puts, deletes, transactions and leases. It is all the arbiter and the
//! fleet need, and it needs no async runtime, which the VMM has none of.
//!
//! Every call is one HTTP request that gives up after `REQUEST_TIMEOUT`; a
//! caller that retries a write after a timeout must make it idempotent
//! (a transaction that checks what it would have written).

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

/// One request to etcd gives up after this long.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(1000);

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd at {endpoint} is unreachable: {err}")]
    Unreachable { endpoint: String, err: String },
    #[error("etcd at {endpoint} answered something unexpected: {what}")]
    Protocol { endpoint: String, what: String },
}

/// A key as etcd holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision of the key's last change (what a conditioned write compares).
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none).
    pub lease: i64,
}

/// A condition of a transaction.
#[derive(Clone, Debug)]
pub enum Compare {
    /// The key was last changed at this revision (0: it does not exist).
    ModRevision(String, i64),
}

/// A step of a transaction.
#[derive(Clone, Debug)]
pub enum Op {
    /// Write the key, attached to a lease (0: none).
    Put {
        key: String,
        value: Vec<u8>,
        lease: i64,
    },
    Delete(String),
    /// Every key under the prefix.
    DeletePrefix(String),
    Get(String),
}

/// A transaction's outcome: whether its conditions held, the store's
/// revision after it, and the keys its `Get` steps read, in order.
#[derive(Debug)]
pub struct TxnOutcome {
    pub succeeded: bool,
    pub revision: i64,
    pub got: Vec<Option<KeyValue>>,
}

/// A client for one etcd endpoint (`http://HOST:PORT`).
#[derive(Clone)]
pub struct Client {
    endpoint: String,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd({})", self.endpoint)
    }
}

/// The end of the range of keys starting with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: no end, all keys from the prefix on ("\0").
    vec![0]
}

fn number(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

impl Client {
    pub fn new(endpoint: &str) -> Client {
        let agent = ureq::Agent::config_builder().timeout_global(Some(REQUEST_TIMEOUT)).http_status_as_error(false).build().into();
        Client { endpoint: endpoint.trim_end_matches('/').to_string(), agent }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn protocol(&self, what: impl Into<String>) -> EtcdError {
        EtcdError::Protocol { endpoint: self.endpoint.clone(), what: what.into() }
    }

    fn call(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let url = format!("{}{path}", self.endpoint);
        let unreachable = |err: String| EtcdError::Unreachable { endpoint: self.endpoint.clone(), err };
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

    fn revision(&self, reply: &Value) -> Result<i64, EtcdError> {
        number(&reply["header"]["revision"]).ok_or_else(|| self.protocol("no revision in the reply"))
    }

    fn decode(&self, kv: &Value) -> Result<KeyValue, EtcdError> {
        let field = |name: &str| -> Result<Vec<u8>, EtcdError> {
            B64.decode(kv[name].as_str().unwrap_or("")).map_err(|e| self.protocol(format!("{name} is not base64: {e}")))
        };
        let key = String::from_utf8(field("key")?).map_err(|_| self.protocol("a key is not UTF-8"))?;
        let mod_revision = number(&kv["mod_revision"]).ok_or_else(|| self.protocol("no mod_revision"))?;
        Ok(KeyValue { key, value: field("value")?, mod_revision, lease: number(&kv["lease"]).unwrap_or(0) })
    }

    fn decode_all(&self, range: &Value) -> Result<Vec<KeyValue>, EtcdError> {
        range["kvs"].as_array().map(|kvs| kvs.iter().map(|kv| self.decode(kv)).collect()).unwrap_or(Ok(Vec::new()))
    }

    /// The key, if it exists, and the store's revision.
    pub fn get(&self, key: &str) -> Result<(Option<KeyValue>, i64), EtcdError> {
        let reply = self.call("/v3/kv/range", json!({ "key": B64.encode(key) }))?;
        Ok((self.decode_all(&reply)?.into_iter().next(), self.revision(&reply)?))
    }

    /// Every key starting with `prefix`, in key order, read at one
    /// revision, and that revision.
    pub fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        let reply = self.call("/v3/kv/range", json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) }))?;
        Ok((self.decode_all(&reply)?, self.revision(&reply)?))
    }

    /// Write the key, attached to `lease` (0: none); the new revision.
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        let reply = self.call("/v3/kv/put", put_body(key, value, lease))?;
        self.revision(&reply)
    }

    /// Delete the key; whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, EtcdError> {
        let reply = self.call("/v3/kv/deleterange", json!({ "key": B64.encode(key) }))?;
        Ok(number(&reply["deleted"]).unwrap_or(0) > 0)
    }

    /// Run `success` if every condition holds, `failure` otherwise, atomically.
    pub fn txn(&self, compare: &[Compare], success: &[Op], failure: &[Op]) -> Result<TxnOutcome, EtcdError> {
        let ops = |ops: &[Op]| ops.iter().map(op_body).collect::<Vec<_>>();
        let reply = self.call(
            "/v3/kv/txn",
            json!({ "compare": compare.iter().map(compare_body).collect::<Vec<_>>(), "success": ops(success), "failure": ops(failure) }),
        )?;
        let succeeded = reply["succeeded"].as_bool().unwrap_or(false);
        let ran = if succeeded { success } else { failure };
        let mut got = Vec::new();
        for (op, response) in ran.iter().zip(reply["responses"].as_array().into_iter().flatten()) {
            if let Op::Get(_) = op {
                got.push(self.decode_all(&response["response_range"])?.into_iter().next());
            }
        }
        Ok(TxnOutcome { succeeded, revision: self.revision(&reply)?, got })
    }

    /// A new lease that expires `ttl` after its last keep-alive; its ID.
    pub fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let reply = self.call("/v3/lease/grant", json!({ "TTL": ttl.as_secs().max(1).to_string() }))?;
        number(&reply["ID"]).filter(|id| *id != 0).ok_or_else(|| self.protocol(format!("no lease granted: {reply}")))
    }

    /// Renew the lease; false if it already expired (its keys are gone).
    pub fn keep_alive(&self, lease: i64) -> Result<bool, EtcdError> {
        let reply = self.call("/v3/lease/keepalive", json!({ "ID": lease.to_string() }))?;
        Ok(number(&reply["result"]["TTL"]).unwrap_or(0) > 0)
    }

    /// End the lease now, deleting its keys.
    pub fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() })).map(drop)
    }
}

fn put_body(key: &str, value: &[u8], lease: i64) -> Value {
    let mut body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
    if lease != 0 {
        body["lease"] = json!(lease.to_string());
    }
    body
}

fn compare_body(c: &Compare) -> Value {
    match c {
        Compare::ModRevision(key, 0) => json!({ "key": B64.encode(key), "target": "CREATE", "create_revision": "0" }),
        Compare::ModRevision(key, rev) => json!({ "key": B64.encode(key), "target": "MOD", "mod_revision": rev.to_string() }),
    }
}

fn op_body(op: &Op) -> Value {
    match op {
        Op::Put { key, value, lease } => json!({ "request_put": put_body(key, value, *lease) }),
        Op::Delete(key) => json!({ "request_delete_range": { "key": B64.encode(key) } }),
        Op::DeletePrefix(prefix) => {
            json!({ "request_delete_range": { "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) } })
        }
        Op::Get(key) => json!({ "request_range": { "key": B64.encode(key) } }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_after_its_last_key() {
        assert_eq!(prefix_end("ftvm/"), b"ftvm0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn numbers_come_as_strings_or_numbers() {
        assert_eq!(number(&json!("42")), Some(42));
        assert_eq!(number(&json!(7)), Some(7));
        assert_eq!(number(&json!(null)), None);
    }
}
