//! The fleet's keys in etcd, and the transactions that change them.
//!
//! ```text
//! ftvm/fleet/hosts/HOST          Host      under the host agent's lease
//! ftvm/fleet/drain/HOST          "1"       the operator drains the host
//! ftvm/fleet/vms/VM              VmSpec    the operator's
//! ftvm/fleet/placement/VM        Placement the leader's
//! ftvm/fleet/reports/VM/HOST     Report    under the host agent's lease
//! ftvm/fleet/unplaced/VM         why       the leader's: what the VM lacks
//! ftvm/fleet/leader              HOST      under the leader agent's lease
//! ```
//!
//! The whole fleet is read with one range request, so what the leader
//! decides from is one consistent revision.

use std::time::Duration;

use ftvm_etcd::{Client, Compare, EtcdError, Op};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::placement::{Change, Fleet};
use crate::records::{Host, Placement, Report};
use crate::spec::VmSpec;

const PREFIX: &str = "ftvm/fleet/";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("a VM named {0} exists already")]
    VmExists(String),
    #[error("no VM named {0}")]
    NoVm(String),
    #[error("no host named {0} has an agent running")]
    NoHost(String),
    #[error("an agent for host {0} is running already")]
    HostTaken(String),
    #[error("the lease of this agent expired: its host left the fleet")]
    LeaseExpired,
}

fn key(kind: &str, name: &str) -> String {
    format!("{PREFIX}{kind}/{name}")
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("fleet records serialize")
}

fn parse<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Option<T> {
    serde_json::from_slice(bytes).map_err(|e| tracing::warn!("fleet: ignoring {key}: {e}")).ok()
}

/// The fleet's view of one etcd.
#[derive(Clone, Debug)]
pub struct Store {
    etcd: Client,
}

impl Store {
    pub fn new(endpoint: &str) -> Store {
        Store { etcd: Client::new(endpoint) }
    }

    pub fn endpoint(&self) -> &str {
        self.etcd.endpoint()
    }

    /// The whole fleet at one revision. Keys that do not parse are left out
    /// (with a warning): a stray key must not stop the fleet.
    pub fn read(&self) -> Result<Fleet, StoreError> {
        let (kvs, revision) = self.etcd.get_prefix(PREFIX)?;
        let mut fleet = Fleet { revision, ..Fleet::default() };
        for kv in kvs {
            let rest = &kv.key[PREFIX.len()..];
            let (kind, name) = rest.split_once('/').unwrap_or((rest, ""));
            match kind {
                "hosts" => fleet.hosts.extend(parse::<Host>(&kv.key, &kv.value).map(|h| (name.to_string(), h))),
                "drain" => {
                    fleet.draining.insert(name.to_string());
                }
                "vms" => fleet.vms.extend(parse::<VmSpec>(&kv.key, &kv.value).map(|s| (name.to_string(), s))),
                "placement" => {
                    fleet.placements.extend(parse::<Placement>(&kv.key, &kv.value).map(|p| (name.to_string(), (p, kv.mod_revision))))
                }
                "reports" => {
                    if let (Some((vm, host)), Some(report)) = (name.split_once('/'), parse::<Report>(&kv.key, &kv.value)) {
                        fleet.reports.entry(vm.to_string()).or_default().insert(host.to_string(), report);
                    }
                }
                "leader" => fleet.leader = String::from_utf8(kv.value).ok(),
                "unplaced" => {
                    fleet.unplaced.insert(name.to_string(), String::from_utf8_lossy(&kv.value).into_owned());
                }
                _ => {}
            }
        }
        Ok(fleet)
    }

    /// Add a VM; refused if one of that name exists.
    pub fn create_vm(&self, spec: &VmSpec) -> Result<(), StoreError> {
        let k = key("vms", &spec.name);
        let done = self.etcd.txn(&[Compare::ModRevision(k.clone(), 0)], &[Op::Put { key: k, value: json(spec), lease: 0 }], &[])?;
        if !done.succeeded {
            return Err(StoreError::VmExists(spec.name.clone()));
        }
        Ok(())
    }

    /// Remove a VM: its agents stop its processes once its placement is gone.
    pub fn delete_vm(&self, name: &str) -> Result<(), StoreError> {
        let done = self.etcd.txn(
            &[Compare::ModRevision(key("vms", name), 0)],
            &[],
            &[
                Op::Delete(key("vms", name)),
                Op::Delete(key("placement", name)),
                Op::Delete(key("unplaced", name)),
                Op::DeletePrefix(key("reports", &format!("{name}/"))),
            ],
        )?;
        if done.succeeded {
            return Err(StoreError::NoVm(name.to_string()));
        }
        Ok(())
    }

    /// Drain a host: it takes no new VM, hands its primaries over and its backups move.
    pub fn drain(&self, host: &str) -> Result<(), StoreError> {
        if self.etcd.get(&key("hosts", host))?.0.is_none() {
            return Err(StoreError::NoHost(host.to_string()));
        }
        self.etcd.put(&key("drain", host), b"1", 0)?;
        Ok(())
    }

    /// Let a drained host take VMs again.
    pub fn undrain(&self, host: &str) -> Result<bool, StoreError> {
        Ok(self.etcd.delete(&key("drain", host))?)
    }

    /// A lease that lives while its agent renews it.
    pub fn lease(&self, ttl: Duration) -> Result<i64, StoreError> {
        Ok(self.etcd.grant(ttl)?)
    }

    /// Renew the agent's lease; an expired one means the fleet counted the
    /// host dead (its VMs were moved), so the agent must not go on as it was.
    pub fn renew(&self, lease: i64) -> Result<(), StoreError> {
        if !self.etcd.keep_alive(lease)? {
            return Err(StoreError::LeaseExpired);
        }
        Ok(())
    }

    pub fn revoke(&self, lease: i64) -> Result<(), StoreError> {
        Ok(self.etcd.revoke(lease)?)
    }

    /// Enter `host` in the fleet under `lease`; refused while the host's key
    /// is held under another live lease (another agent's).
    pub fn register(&self, host: &Host, lease: i64) -> Result<(), StoreError> {
        let k = key("hosts", &host.name);
        let (held, _) = self.etcd.get(&k)?;
        let seen = match held {
            Some(kv) if kv.lease != lease => return Err(StoreError::HostTaken(host.name.clone())),
            Some(kv) => kv.mod_revision,
            None => 0,
        };
        let done = self.etcd.txn(&[Compare::ModRevision(k.clone(), seen)], &[Op::Put { key: k, value: json(host), lease }], &[])?;
        if !done.succeeded {
            return Err(StoreError::HostTaken(host.name.clone()));
        }
        Ok(())
    }

    /// Become the leader as `host` if nobody is; whether `host` leads now.
    pub fn lead(&self, host: &str, lease: i64) -> Result<bool, StoreError> {
        let k = format!("{PREFIX}leader");
        let done = self.etcd.txn(
            &[Compare::ModRevision(k.clone(), 0)],
            &[Op::Put { key: k.clone(), value: host.as_bytes().to_vec(), lease }],
            &[Op::Get(k)],
        )?;
        Ok(done.succeeded || done.got.into_iter().next().flatten().is_some_and(|kv| kv.value == host.as_bytes() && kv.lease == lease))
    }

    /// Write a placement unless it changed since it was read; whether it was written.
    pub fn place(&self, change: &Change) -> Result<bool, StoreError> {
        let k = key("placement", &change.vm);
        // The spec must still exist: a VM deleted meanwhile is not placed again.
        let spec = key("vms", &change.vm);
        let (vm, _) = self.etcd.get(&spec)?;
        let Some(vm) = vm else { return Ok(false) };
        let done = self.etcd.txn(
            &[Compare::ModRevision(k.clone(), change.seen), Compare::ModRevision(spec, vm.mod_revision)],
            &[Op::Put { key: k, value: json(&change.placement), lease: 0 }],
            &[],
        )?;
        Ok(done.succeeded)
    }

    /// Say why `vm` lacks a host or a backup (`None`: it lacks nothing).
    pub fn set_unplaced(&self, vm: &str, why: Option<&str>) -> Result<(), StoreError> {
        match why {
            Some(why) => self.etcd.put(&key("unplaced", vm), why.as_bytes(), 0).map(drop)?,
            None => self.etcd.delete(&key("unplaced", vm)).map(drop)?,
        }
        Ok(())
    }

    /// Record what runs for `vm` on the report's host, under `lease`.
    pub fn report(&self, vm: &str, report: &Report, lease: i64) -> Result<(), StoreError> {
        self.etcd.put(&key("reports", &format!("{vm}/{}", report.host)), &json(report), lease)?;
        Ok(())
    }

    /// Nothing runs for `vm` on `host` any more.
    pub fn unreport(&self, vm: &str, host: &str) -> Result<(), StoreError> {
        self.etcd.delete(&key("reports", &format!("{vm}/{host}")))?;
        Ok(())
    }
}
