//! The core of a Redis-protocol (RESP2) key-value server, independent of any
//! transport, clock or disk: the caller feeds each connection's bytes to
//! [`Server::handle`] with the current time and a [`LogSink`], and sends
//! back what it appends to `out`. [`Server::handle_us`] takes the time in
//! microseconds, which only TIME reports at that resolution.
//!
//! Built `no_std` (with `alloc`) for ftvm guests; tested on the host.
//!
//! # Persistence
//!
//! Every command that changes the store is first encoded as a record and
//! handed to the [`LogSink`]; the store changes, and the client hears
//! success, only if the sink accepts it. Records are RESP arrays of bulk
//! strings in a normalized form that does not depend on when it is replayed
//! (see [`Server::replay`]):
//!
//! | command | record |
//! |---|---|
//! | SET (any options), INCR/DECR/INCRBY/DECRBY, APPEND to a missing key | `SET key value` or `SET key value PXAT <absolute ms>` |
//! | APPEND to an existing key | `APPEND key suffix` |
//! | DEL | `DEL` with the keys that existed (none existed: no record) |
//! | MSET | `MSET k v ...` |
//! | FLUSHALL, FLUSHDB | `FLUSHALL` |
//!
//! Commands that change nothing (SET NX on an existing key, DEL of missing
//! keys, every read) log nothing. [`aof`] frames records on a byte device.

#![no_std]

extern crate alloc;

pub mod aof;
mod cmd;
mod connection;
mod glob;
mod log;
mod num;
mod parse;
mod replay;
mod reply;
mod server;
mod store;

pub use cmd::Flow;
pub use connection::Connection;
pub use log::{LogError, LogSink, NoLog, ReplayError};
pub use parse::{MAX_ARGS, MAX_BULK_LEN, MAX_INLINE_LEN, MAX_REQUEST_LEN};
pub use server::{Server, MEMORY_RESERVE};
