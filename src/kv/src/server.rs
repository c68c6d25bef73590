//! The server object: the store and the server-wide state that commands
//! read and change. The request loop that feeds it is in `connection`, log
//! replay in `replay`.

use alloc::vec::Vec;

use crate::parse::Parser;
use crate::store::{Db, NEVER};

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
}

#[derive(Default)]
pub(crate) struct Stats {
    pub commands: u64,
    pub hits: u64,
    pub misses: u64,
    pub expired: u64,
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
        }
    }

    /// What `CONFIG GET appendonly` and INFO report; the glue sets it when
    /// it persists the log. It changes nothing else.
    pub fn set_appendonly(&mut self, on: bool) {
        self.appendonly = on;
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
