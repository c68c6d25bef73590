//! The server object: the store and the server-wide state that commands
//! read and change. The request loop that feeds it is in `connection`, log
//! replay in `replay`.

use alloc::vec::Vec;

use crate::parse::Parser;
use crate::store::{Db, NEVER};

/// What a write must leave free (`set_free_memory`): room for the
/// connections' buffers and replies, the network stack and a log record.
pub const MEMORY_RESERVE: usize = 1 << 20;

/// The store and its configuration. One per guest; connections share it.
pub struct Server {
    pub(crate) db: Db,
    pub(crate) appendonly: bool,
    pub(crate) stats: Stats,
    /// Reused buffer for encoding log records.
    pub(crate) record: Vec<u8>,
    pub(crate) replay_parser: Parser,
    /// `now_ms` of the first call, for INFO's uptime.
    pub(crate) started_ms: Option<u64>,
    /// Bytes the allocator has free (`set_free_memory`).
    pub(crate) free_memory: Option<fn() -> usize>,
}

#[derive(Default)]
pub(crate) struct Stats {
    pub commands: u64,
    pub hits: u64,
    pub misses: u64,
    pub expired: u64,
    /// Writes refused for memory (`-OOM`).
    pub oom_refused: u64,
    /// Connections closed because their buffers could not grow
    /// (`count_oom_closed`).
    pub oom_closed: u64,
}

impl Default for Server {
    fn default() -> Server {
        Server::new()
    }
}

impl Server {
    pub fn new() -> Server {
        Server {
            db: Db::default(),
            appendonly: false,
            stats: Stats::default(),
            record: Vec::new(),
            replay_parser: Parser::default(),
            started_ms: None,
            free_memory: None,
        }
    }

    /// What `CONFIG GET appendonly` and INFO report; the glue sets it when
    /// it persists the log. It changes nothing else.
    pub fn set_appendonly(&mut self, on: bool) {
        self.appendonly = on;
    }

    /// How the server learns what memory is left: writes that would leave
    /// less than [`MEMORY_RESERVE`] free are refused with `-OOM` (as Redis
    /// with `maxmemory` and no eviction), so that a full guest goes on
    /// serving reads and its connections rather than failing an
    /// allocation, which ends the guest. Without it only the table's
    /// growth is checked.
    pub fn set_free_memory(&mut self, free: fn() -> usize) {
        self.free_memory = Some(free);
    }

    /// Count a connection the transport closed because the heap could not
    /// give its buffers (INFO's `oom_closed_connections`).
    pub fn count_oom_closed(&mut self) {
        self.stats.oom_closed += 1;
    }

    /// Live keys as of the latest `now_ms` seen by `handle`, `replay` or
    /// `expire`.
    pub fn dbsize(&self) -> usize {
        self.db.len()
    }

    /// Drop every key expired at `now_ms`, returning how many. `handle` and
    /// `replay` do this themselves; an idle transport may call it to give
    /// back memory sooner. Expiry is not logged: records carry absolute
    /// times, so replay expires the same keys by itself.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let now = clamp(now_ms);
        self.started_ms.get_or_insert(now);
        let n = self.db.sweep(now);
        self.stats.expired += n as u64;
        n
    }
}

/// `NEVER` marks keys without expiry, so no real time may reach it.
pub(crate) fn clamp(now_ms: u64) -> u64 {
    now_ms.min(NEVER - 1)
}
