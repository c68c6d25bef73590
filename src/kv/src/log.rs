//! Where the server sends the records of its mutations, and what can go
//! wrong with them.

use core::fmt;

/// Receives one record per mutating command, before the command takes
/// effect. Records are RESP arrays of bulk strings (see the crate docs); a
/// sink that persists them typically frames each with [`crate::aof::encode`].
pub trait LogSink {
    /// Persist (or queue for persisting) `record`. On `Err` the command is
    /// not applied and the client gets an error reply.
    fn append(&mut self, record: &[u8]) -> Result<(), LogError>;

    /// Whether records are wanted at all. A sink returning `false` is never
    /// called, which saves encoding a record per write when persistence is
    /// off.
    fn enabled(&self) -> bool {
        true
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogError {
    /// The log device has no room for the record.
    Full,
    /// The log device failed.
    Io,
}

impl fmt::Display for LogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl LogError {
    pub fn as_str(self) -> &'static str {
        match self {
            LogError::Full => "disk full",
            LogError::Io => "I/O error",
        }
    }
}

/// Persistence off: accepts everything, and asks for nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoLog;

impl LogSink for NoLog {
    fn append(&mut self, _record: &[u8]) -> Result<(), LogError> {
        Ok(())
    }

    fn enabled(&self) -> bool {
        false
    }
}

/// Why [`crate::Server::replay`] rejected a record. The store is unchanged
/// in every case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayError {
    /// Not exactly one complete RESP array of bulk strings.
    Malformed,
    /// A command that `handle` never logs.
    UnknownCommand,
    /// A known command with the wrong arguments.
    BadArguments,
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReplayError::Malformed => "malformed log record",
            ReplayError::UnknownCommand => "unknown command in log record",
            ReplayError::BadArguments => "bad arguments in log record",
        })
    }
}
