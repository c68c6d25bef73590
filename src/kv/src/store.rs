//! The keyspace: byte-string keys to byte-string values with optional
//! absolute expiry times.
//!
//! Expired keys are treated as absent by every live read (`*_live`), removed
//! lazily when touched, and swept in expiry order by [`Db::sweep`] so that
//! `len` counts only live keys right after a sweep. The `raw_*` operations
//! ignore expiry; log replay uses them, because a log record describes a
//! change to keys that were live when it was written, even if they have
//! expired by the time the log is replayed.

use alloc::boxed::Box;
use alloc::collections::BinaryHeap;
use alloc::vec::Vec;
use core::cmp::Reverse;

use foldhash::fast::FixedState;
use hashbrown::HashMap;

/// `expire_at` of a key without a time to live.
pub const NEVER: u64 = u64::MAX;

pub struct Entry {
    pub value: Vec<u8>,
    /// Absolute guest time in ms at which the key stops existing.
    pub expire_at: u64,
}

impl Entry {
    #[inline]
    pub fn live(&self, now: u64) -> bool {
        self.expire_at > now
    }
}

#[derive(Default)]
pub struct Db {
    /// Hashed with a fixed seed: the guest has no random source to seed
    /// from, and a fixed seed makes the table's layout (so KEYS order) a
    /// function of its history alone. The price, no defence against
    /// chosen-collision floods, is acceptable for a guest-internal store.
    map: HashMap<Vec<u8>, Entry, FixedState>,
    /// Keys with an expiry time.
    volatile: usize,
    /// Pending expiries, soonest first. Entries go stale when a key is
    /// overwritten or deleted; they are checked against the map when popped
    /// and purged in bulk when they outnumber the live ones.
    timers: BinaryHeap<Reverse<(u64, Box<[u8]>)>>,
}

impl Db {
    /// Keys held, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn volatile(&self) -> usize {
        self.volatile
    }

    /// The live entry for `key`, dropping it if it has expired.
    #[inline]
    pub fn get_live(&mut self, key: &[u8], now: u64) -> Option<&mut Entry> {
        let expired = match self.map.get(key) {
            None => return None,
            Some(e) => !e.live(now),
        };
        if expired {
            self.remove(key);
            return None;
        }
        self.map.get_mut(key)
    }

    /// Like [`Db::get_live`] but without removing an expired key, for
    /// read paths that only hold `&self`.
    #[inline]
    pub fn peek_live(&self, key: &[u8], now: u64) -> Option<&Entry> {
        self.map.get(key).filter(|e| e.live(now))
    }

    pub fn raw_get_mut(&mut self, key: &[u8]) -> Option<&mut Entry> {
        self.map.get_mut(key)
    }

    /// Whether `keys` more keys and `bytes` more of keys and values fit:
    /// the table grows now if it must, fallibly. Its doubling is the one
    /// large allocation a write makes (tens of MiB in a small guest), where
    /// an infallible one would end the guest; a value is probed only when
    /// it is large enough to matter.
    pub fn room_for(&mut self, keys: usize, bytes: usize) -> bool {
        const PROBE_FROM: usize = 64 * 1024;
        self.map.try_reserve(keys).is_ok() && (bytes < PROBE_FROM || Vec::<u8>::new().try_reserve_exact(bytes).is_ok())
    }

    /// Store `value` under `key`, replacing any previous value and expiry.
    pub fn set(&mut self, key: &[u8], value: &[u8], expire_at: u64) {
        let new_timer = match self.map.get_mut(key) {
            Some(e) => {
                // Reuse the old buffer when it is not grossly oversized: the
                // common SET-over-SET of similar sizes then allocates nothing.
                if e.value.capacity() <= 2 * value.len() + 64 {
                    e.value.clear();
                    e.value.extend_from_slice(value);
                } else {
                    e.value = value.to_vec();
                }
                let was = core::mem::replace(&mut e.expire_at, expire_at);
                self.volatile -= usize::from(was != NEVER);
                // INCR on a volatile key keeps its time: no second timer.
                was != expire_at
            }
            None => {
                self.map.insert(key.to_vec(), Entry { value: value.to_vec(), expire_at });
                true
            }
        };
        if expire_at != NEVER {
            self.volatile += 1;
            if new_timer {
                self.add_timer(key, expire_at);
            }
        }
    }

    /// Append to the value under `key` (creating it) regardless of expiry;
    /// the key keeps its expiry. Returns the new length.
    pub fn raw_append(&mut self, key: &[u8], suffix: &[u8]) -> usize {
        match self.map.get_mut(key) {
            Some(e) => {
                e.value.extend_from_slice(suffix);
                e.value.len()
            }
            None => {
                self.map.insert(key.to_vec(), Entry { value: suffix.to_vec(), expire_at: NEVER });
                suffix.len()
            }
        }
    }

    /// Remove `key`; returns whether it was there and live at `now`.
    pub fn remove_live(&mut self, key: &[u8], now: u64) -> bool {
        match self.map.remove(key) {
            None => false,
            Some(e) => {
                self.volatile -= usize::from(e.expire_at != NEVER);
                e.live(now)
            }
        }
    }

    /// Remove `key` regardless of expiry; returns whether it was there.
    pub fn remove(&mut self, key: &[u8]) -> bool {
        self.remove_live(key, 0)
    }

    pub fn clear(&mut self) {
        // A fresh table rather than `clear()`, which keeps the capacity: a
        // flushed big keyspace should give its memory back.
        self.map = HashMap::default();
        self.timers = BinaryHeap::new();
        self.volatile = 0;
    }

    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &Entry)> {
        self.map.iter().map(|(k, e)| (&k[..], e))
    }

    /// Remove every key whose expiry time is at or before `now`; returns how
    /// many. Costs O(log n) per expired key and O(1) when none is due.
    pub fn sweep(&mut self, now: u64) -> usize {
        let mut removed = 0;
        while let Some(Reverse((at, _))) = self.timers.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((at, key))) = self.timers.pop() else {
                break;
            };
            // Only if the key still carries this timer's expiry time; a
            // stale timer belongs to an overwritten or deleted incarnation.
            if self.map.get(&key[..]).is_some_and(|e| e.expire_at == at) {
                self.remove(&key);
                removed += 1;
            }
        }
        removed
    }

    fn add_timer(&mut self, key: &[u8], at: u64) {
        // Rebuild when stale timers dominate, so a loop re-setting one key
        // with a long TTL cannot grow the heap without bound.
        if self.timers.len() >= 1024 && self.timers.len() > 2 * self.volatile {
            let timers =
                self.map.iter().filter(|(_, e)| e.expire_at != NEVER).map(|(k, e)| Reverse((e.expire_at, Box::from(&k[..])))).collect();
            self.timers = timers;
            // The key being set is already in the map with its new expiry.
            return;
        }
        self.timers.push(Reverse((at, Box::from(key))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Growth that cannot be had is a refusal, not an abort: the table's
    /// reservation and the probe of a large value are both fallible.
    #[test]
    fn room_that_cannot_be_had_is_refused() {
        let mut db = Db::default();
        db.set(b"a", b"1", NEVER);
        assert!(db.room_for(1, 10));
        assert!(!db.room_for(usize::MAX / 2, 0), "a table that cannot grow");
        assert!(!db.room_for(1, isize::MAX as usize), "a value that cannot be allocated");
        assert_eq!(db.len(), 1);
    }
}
