//! The arbiter: who owns a replicated VM's output, decided by one atomic
//! compare-and-swap in etcd (VMware FT's test-and-set on shared storage).
//!
//! The key `ftvm/<name>/owner` holds `{"generation": G, "owner": ID}`. A
//! side claims ownership by swapping in generation G+1 under the condition
//! that the key is still at the revision it last saw; of a primary and a
//! backup that both try after losing each other, exactly one wins. The
//! loser never emits again. Spoken over etcd's v3 JSON gateway (plain
//! HTTP, keys and values base64), about 2 ms per transaction on loopback.

use ftvm_etcd::{Client, Compare, EtcdError, KeyValue, Op};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ArbiterError {
    #[error("the arbiter at {endpoint} is unreachable: {err}")]
    Unreachable { endpoint: String, err: String },
    #[error("the arbiter at {endpoint} answered something unexpected: {what}")]
    Protocol { endpoint: String, what: String },
}

impl From<EtcdError> for ArbiterError {
    fn from(e: EtcdError) -> ArbiterError {
        match e {
            EtcdError::Unreachable { endpoint, err } => ArbiterError::Unreachable { endpoint, err },
            EtcdError::Protocol { endpoint, what } => ArbiterError::Protocol { endpoint, what },
        }
    }
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
    etcd: Client,
    key: String,
}

impl std::fmt::Debug for Arbiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Arbiter({}, {})", self.etcd.endpoint(), self.key)
    }
}

impl Arbiter {
    /// The arbiter at `endpoint` (`http://HOST:PORT`) for the VM called `name`.
    pub fn new(endpoint: &str, name: &str) -> Arbiter {
        Arbiter { etcd: Client::new(endpoint), key: owner_key(name) }
    }

    pub fn endpoint(&self) -> &str {
        self.etcd.endpoint()
    }

    fn decode(&self, kv: &KeyValue) -> Result<Ownership, ArbiterError> {
        let record: Record = serde_json::from_slice(&kv.value).map_err(|e| ArbiterError::Protocol {
            endpoint: self.endpoint().to_string(),
            what: format!("value is not an ownership record: {e}"),
        })?;
        Ok(Ownership { generation: record.generation, owner: record.owner, revision: kv.mod_revision })
    }

    /// The current owner; generation 0 and revision 0 when there is none.
    pub fn read(&self) -> Result<Ownership, ArbiterError> {
        match self.etcd.get(&self.key)?.0 {
            Some(kv) => self.decode(&kv),
            None => Ok(Ownership { generation: 0, owner: String::new(), revision: 0 }),
        }
    }

    /// Become the owner as `me` (unique to this process: see `identity`),
    /// provided ownership is still as `seen`. Retrying after an error is
    /// safe: a claim of ours that did reach etcd counts as won.
    pub fn claim(&self, seen: &Ownership, me: &str) -> Result<Claim, ArbiterError> {
        let next = Record { generation: seen.generation + 1, owner: me.to_string() };
        let value = serde_json::to_vec(&next).expect("record serializes");
        let outcome = self.etcd.txn(
            &[Compare::ModRevision(self.key.clone(), seen.revision)],
            &[Op::Put { key: self.key.clone(), value, lease: 0 }],
            &[Op::Get(self.key.clone())],
        )?;
        if outcome.succeeded {
            return Ok(Claim::Won(Ownership { generation: next.generation, owner: next.owner, revision: outcome.revision }));
        }
        let Some(current) = outcome.got.into_iter().next().flatten() else {
            return Ok(Claim::Lost(Ownership { generation: 0, owner: String::new(), revision: 0 }));
        };
        let current = self.decode(&current)?;
        // A retry after a request that timed out on our side but reached
        // etcd: the earlier attempt won, and it was ours.
        if current.owner == me && current.generation == next.generation {
            return Ok(Claim::Won(current));
        }
        Ok(Claim::Lost(current))
    }
}

/// The key holding the ownership of the VM called `name`.
pub fn owner_key(name: &str) -> String {
    format!("ftvm/{name}/owner")
}
