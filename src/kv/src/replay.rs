//! Boot-time replay of log records.
//!
//! Records are the normalized forms `handle` logs: `SET k v [PXAT ms]`,
//! `APPEND k suffix`, `DEL k...`, `MSET k v...`, `FLUSHALL`. Each describes
//! its effect on keys that were live when it was written, so replaying at a
//! later `now` gives the state as of that `now`: a SET whose time has
//! passed leaves no key, and an APPEND whose key has since expired (and
//! been swept) stays a no-op rather than resurrecting the key without its
//! expiry.

use crate::cmd::{apply_set, eq_ignore_case};
use crate::log::ReplayError;
use crate::num::parse_i64;
use crate::parse::Step;
use crate::server::{clamp, Server};
use crate::store::NEVER;

impl Server {
    /// Re-apply one record produced earlier by `handle`. On error the store
    /// is unchanged.
    pub fn replay(&mut self, record: &[u8], now_ms: u64) -> Result<(), ReplayError> {
        self.expire(now_ms);
        let now = clamp(now_ms);
        let res = match self.replay_parser.next(record) {
            Step::Command(n) if n == record.len() && record.first() == Some(&b'*') => {
                let a = self.replay_parser.args(record);
                let name = a.get(0);
                let db = &mut self.db;
                if eq_ignore_case(name, "set") {
                    let at = match a.len() {
                        3 => Some(NEVER),
                        5 if eq_ignore_case(a.get(3), "pxat") => parse_i64(a.get(4)).filter(|&t| t >= 0).map(|t| t as u64),
                        _ => None,
                    };
                    match at {
                        Some(at) => {
                            apply_set(db, a.get(1), a.get(2), at, now);
                            Ok(())
                        }
                        None => Err(ReplayError::BadArguments),
                    }
                } else if eq_ignore_case(name, "append") {
                    if a.len() != 3 {
                        Err(ReplayError::BadArguments)
                    } else {
                        if let Some(e) = db.raw_get_mut(a.get(1)) {
                            e.value.extend_from_slice(a.get(2));
                        }
                        Ok(())
                    }
                } else if eq_ignore_case(name, "del") {
                    if a.len() < 2 {
                        Err(ReplayError::BadArguments)
                    } else {
                        for k in a.iter().skip(1) {
                            db.remove(k);
                        }
                        Ok(())
                    }
                } else if eq_ignore_case(name, "mset") {
                    if a.len() < 3 || a.len().is_multiple_of(2) {
                        Err(ReplayError::BadArguments)
                    } else {
                        for i in (1..a.len()).step_by(2) {
                            db.set(a.get(i), a.get(i + 1), NEVER);
                        }
                        Ok(())
                    }
                } else if eq_ignore_case(name, "flushall") {
                    if a.len() != 1 {
                        Err(ReplayError::BadArguments)
                    } else {
                        db.clear();
                        Ok(())
                    }
                } else {
                    Err(ReplayError::UnknownCommand)
                }
            }
            _ => Err(ReplayError::Malformed),
        };
        self.replay_parser.reset();
        res
    }
}
