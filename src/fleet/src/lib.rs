//! The fleet: every VM kept protected across a pool of hosts.
//!
//! What the operator wants is a set of VM specs (`spec`); what the pool
//! has is the hosts whose agents are alive (`records::Host`, each kept in
//! etcd under its agent's lease, so a dead host's record expires on its
//! own). One agent at a time is the leader (`store::Store::lead`): it
//! reads the whole fleet at one etcd revision, decides where each VM's
//! primary and backup belong (`placement::plan`, a pure function of what
//! it read), and writes each decision in a transaction conditioned on the
//! revision of the placement it replaces, so a leader that lost its lease
//! in the meantime changes nothing. Every agent runs what the placements
//! give its host and reports what runs (`records::Report`, under its lease).
//!
//! Failing over is not the leader's job: a VM's backup takes over by
//! itself through the arbiter as without a fleet. The leader only follows:
//! a primary whose host is gone is where its backup was, and a VM without
//! a backup gets one on another host with room. Once nothing needs
//! fixing, it evens the hosts out, one VM at a time. A VSMR VM's three
//! replicas elect their own leader; the leader only replaces a replica
//! whose host is gone by a new one (`slots`).

pub mod placement;
pub mod records;
mod room;
mod slots;
pub mod spec;
pub mod store;
pub mod view;

pub use records::{Host, Placement, Replacement, Report, Role, Slot};
pub use spec::{Protection, SpecError, VmSpec};
pub use store::{Store, StoreError};
pub use view::Fleet;
