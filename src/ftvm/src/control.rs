//! The client side of the control API: `ftvm snapshot`, `status`, `pause`,
//! `resume`, `stop`, `protect`, `switchover` and `replica-replace`, each one request to a
//! running VMM and a line (or a status report) about its reply.

use std::path::PathBuf;
use std::time::Duration;

use ftvm_replication::Role;

use crate::api;
use crate::cli::ClientArgs;
use crate::error::RunError;
use crate::output::outln;

/// One request to the VMM at `client.api_socket`.
fn call(client: &ClientArgs, request: api::Request) -> Result<api::Response, RunError> {
    Ok(api::client::call(&client.api_socket, &request, client.timeout)?)
}

/// `ftvm snapshot`: the VM's state written to `output` (`stop`: then stopped).
pub fn snapshot(api_socket: PathBuf, timeout: Duration, output: PathBuf, stop: bool) -> Result<i32, RunError> {
    let path = std::path::absolute(&output).unwrap_or(output);
    let request = api::Request::Snapshot { path: path.display().to_string(), stop };
    let socket = api_socket.display().to_string();
    let r = call(&ClientArgs { api_socket, timeout }, request)?;
    // Every VMM that wrote one says its size.
    let Some(bytes) = r.bytes else {
        return Err(api::client::ClientError::Protocol { path: socket, err: "a snapshot reply without the snapshot's size".into() }.into());
    };
    let pending = match r.disk_pending.unwrap_or(0) {
        0 => String::new(),
        n => format!(", {n} disk request(s) in flight (issued again on restore)"),
    };
    outln!("snapshot {} written: {} bytes, VM paused {} us{pending}", path.display(), bytes, r.pause_us.unwrap_or(0));
    Ok(0)
}

/// `ftvm status`: as text, or the reply as one JSON object.
pub fn status(client: &ClientArgs, json: bool) -> Result<i32, RunError> {
    let r = call(client, api::Request::Status)?;
    if json {
        outln!("{}", serde_json::to_string(&r).expect("responses serialize"));
    } else {
        print_status(&r);
    }
    Ok(0)
}

/// `ftvm pause`, `resume`, `stop`: the request, and what the VM does now.
pub fn simple(client: &ClientArgs, request: api::Request, said: &str) -> Result<i32, RunError> {
    call(client, request)?;
    outln!("{said}");
    Ok(0)
}

/// `ftvm protect`: a new backup for an unprotected primary.
pub fn protect(client: &ClientArgs, backup: String) -> Result<i32, RunError> {
    call(client, api::Request::Protect { backup: backup.clone() })?;
    outln!("protecting with backup {backup}; `ftvm status` shows when it is synchronized");
    Ok(0)
}

/// `ftvm switchover`: the VM handed over to its backup.
pub fn switchover(client: &ClientArgs) -> Result<i32, RunError> {
    let r = call(client, api::Request::Switchover)?;
    let backup = r.replication.map(|st| st.peer).unwrap_or_default();
    outln!("handed over to the backup {backup}; this VMM exits");
    Ok(0)
}

/// `ftvm replica-replace`: the change proposed by the group's leader.
pub fn replica_replace(client: &ClientArgs, remove: u64, add: u64, addr: String) -> Result<i32, RunError> {
    let r = call(client, api::Request::ReplicaReplace { remove, add, addr })?;
    outln!("{}; `ftvm status` shows the members", r.message.as_deref().unwrap_or("proposed"));
    Ok(0)
}

fn print_status(r: &api::Response) {
    outln!("state: {}", r.state.as_deref().unwrap_or("unknown"));
    if let (Some(v), Some(m)) = (r.vcpus, r.memory_mib) {
        outln!("vcpus: {v}");
        outln!("memory: {m} MiB");
    }
    if let Some(w) = r.write_errors.filter(|w| *w != api::WriteErrors::default()) {
        outln!("write errors: {} metrics lines, {} console writes dropped", w.metrics, w.console);
    }
    if let Some(rep) = &r.replication {
        outln!("role: {}", rep.role);
        outln!("protected: {}", if rep.protected { "yes" } else { "no" });
        if matches!(rep.role, Role::Leader | Role::Secondary | Role::Witness) {
            outln!("term: {}", rep.term);
        } else {
            outln!("epoch: {}", rep.epoch);
        }
        if !rep.peer.is_empty() {
            outln!("{}: {}", if rep.role == Role::Primary { "backup" } else { "primary" }, rep.peer);
        }
        if !rep.standbys.is_empty() {
            outln!("standbys: {}", rep.standbys.join(", "));
        }
        outln!("detail: {}", rep.detail);
        if let Some(m) = &r.members {
            let each: Vec<String> = m.members.iter().map(|m| format!("{} {} {}", m.id, m.role, m.addr)).collect();
            outln!("members: {}", each.join(", "));
            if let Some(c) = &m.changing {
                outln!("membership change: {c}");
            }
        }
        if let Some(e) = &rep.election {
            outln!("elected: {e}");
        }
        if let Some(m) = &rep.last_sync {
            outln!(
                "last syncvm {} (term {}): {} pages dirty, {} divergent, pause {} us, {} bytes sent since the previous, {} us after it{}",
                m.index,
                m.term,
                m.dirty_pages,
                m.divergent_pages,
                m.pause_us,
                m.bytes,
                m.interval_us,
                if m.ok { "" } else { " (FAILED)" }
            );
        }
        if let Some(c) = &rep.costs {
            outln!(
                "costs per page ({}): tracked first write {} ns, copy {} ns, hash {} ns, encode {} ns, write-protect {}; so a region is kept writable from {:.0}% of its kept pages rewritten an epoch, and prefetch rounds run while at most {:.0}% of their sends are wasted",
                if c.measured { "measured at start" } else { "assumed" },
                c.first_write_ns,
                c.copy_ns,
                c.hash_ns,
                c.encode_ns,
                if c.protect_ns > 0 { format!("{} ns", c.protect_ns) } else { "not measured".into() },
                c.keep_threshold() * 100.0,
                c.max_waste() * 100.0
            );
        }
        let started = rep.started_by.nonzero();
        if !started.is_empty() {
            let each: Vec<String> = started.iter().map(|(reason, n)| format!("{reason} {n}")).collect();
            outln!("checkpoints started by: {}", each.join(", "));
        }
        if let Some(m) = &rep.last {
            outln!(
                "last epoch {}: started by {}, ran {} us (at most {} us), pause {} us, {} dirty pages, {} bytes, transfer {} us, ack after {} us, {} frames released (held up to {} us)",
                m.epoch,
                m.trigger,
                m.epoch_us,
                m.max_epoch_us,
                m.pause_us,
                m.dirty_pages,
                m.bytes,
                m.transfer_us,
                m.ack_us,
                m.frames_released,
                m.hold_us
            );
            if m.predicted > 0 || m.regions_kept > 0 {
                outln!(
                    "write prediction: {} pages left writable ({} regions of 512 pages kept, {} changed at this checkpoint), {} of them written, {} unchanged (not sent), {} tracked first writes",
                    m.predicted,
                    m.regions_kept,
                    m.regions_flipped,
                    m.predicted_written,
                    m.fake_dirty,
                    m.first_writes
                );
            }
            if m.fake_ack_flows > 0 {
                outln!(
                    "fake ACK: {} flows tracked, {} in bulk mode, {} bytes acknowledged to the guest and not yet by the peer",
                    m.fake_ack_flows,
                    m.fake_ack_bulk_flows,
                    m.fake_ack_bytes
                );
            }
            if m.prefetched_pages > 0 {
                outln!("prefetch: {} pages sent while the guest ran, {} in the stop-and-copy", m.prefetched_pages, m.commit_pages);
            }
        }
    }
}
