//! `--raft-state FILE`: a replica's raft term and vote, kept on disk.
//!
//! Raft's election is safe only if no replica votes twice in one term.
//! The log itself may be lost with a replica (a restarted one catches up
//! and is brought up to date by a full `syncvm`), but its vote may not:
//! one that forgot it could elect a second leader in the same term. So the
//! term and vote are written and synced before any message that depends on
//! them (a vote, an acknowledgement) leaves.
//!
//! The file holds two fixed-size slots written in turn, each with a
//! sequence number and a CRC-32C: a write torn by a crash leaves the other
//! slot whole, and the one with the higher sequence number is read back.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"FTVS";
const FORMAT: u32 = 1;
const SLOT: usize = 48;

#[derive(Debug, thiserror::Error)]
pub enum VoteFileError {
    #[error("cannot open the raft state file {path}: {err}")]
    Open { path: PathBuf, err: io::Error },
    #[error("cannot read the raft state file {path}: {err}")]
    Read { path: PathBuf, err: io::Error },
    #[error("the raft state file {path} is corrupt (no slot with a valid checksum); remove it only if replica {id} never voted")]
    Corrupt { path: PathBuf, id: u64 },
    #[error("the raft state file {path} belongs to replica {theirs}, not to replica {ours}")]
    OtherReplica { path: PathBuf, theirs: u64, ours: u64 },
}

/// The term and the replica voted for in it (0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Vote {
    pub term: u64,
    pub vote: u64,
}

pub struct VoteFile {
    file: File,
    path: PathBuf,
    id: u64,
    seq: u64,
    last: Vote,
}

impl VoteFile {
    /// Open (or create) replica `id`'s file and read back what it holds:
    /// `None` for a new (empty) file.
    pub fn open(path: &Path, id: u64) -> Result<(VoteFile, Option<Vote>), VoteFileError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|err| VoteFileError::Open { path: path.to_owned(), err })?;
        let mut bytes = [0u8; 2 * SLOT];
        let len = read_up_to(&file, &mut bytes).map_err(|err| VoteFileError::Read { path: path.to_owned(), err })?;
        let mut found: Option<(u64, u64, Vote)> = None;
        for slot in bytes[..len].chunks_exact(SLOT) {
            if let Some((owner, seq, vote)) = decode(slot) {
                if found.is_none_or(|(_, s, _)| seq > s) {
                    found = Some((owner, seq, vote));
                }
            }
        }
        let (seq, last) = match found {
            None if len == 0 => (0, None),
            None => return Err(VoteFileError::Corrupt { path: path.to_owned(), id }),
            Some((owner, _, _)) if owner != id => {
                return Err(VoteFileError::OtherReplica { path: path.to_owned(), theirs: owner, ours: id })
            }
            Some((_, seq, vote)) => (seq, Some(vote)),
        };
        Ok((VoteFile { file, path: path.to_owned(), id, seq, last: last.unwrap_or_default() }, last))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Keep `vote` (synced) unless it is what the file holds already.
    pub fn store(&mut self, vote: Vote) -> io::Result<()> {
        if vote == self.last && self.seq > 0 {
            return Ok(());
        }
        let seq = self.seq + 1;
        let offset = (seq % 2) * SLOT as u64;
        self.file.write_all_at(&encode(self.id, seq, vote), offset)?;
        self.file.sync_data()?;
        self.seq = seq;
        self.last = vote;
        Ok(())
    }
}

fn read_up_to(file: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn encode(id: u64, seq: u64, vote: Vote) -> [u8; SLOT] {
    let mut s = [0u8; SLOT];
    s[0..4].copy_from_slice(MAGIC);
    s[4..8].copy_from_slice(&FORMAT.to_le_bytes());
    for (i, v) in [id, seq, vote.term, vote.vote].into_iter().enumerate() {
        s[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    let crc = crc32c::crc32c(&s[..40]);
    s[40..44].copy_from_slice(&crc.to_le_bytes());
    s
}

/// A slot's owner, sequence number and vote, if it is whole.
fn decode(s: &[u8]) -> Option<(u64, u64, Vote)> {
    let word = |i: usize| u64::from_le_bytes(s[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(s[40..44].try_into().expect("4 bytes"));
    let whole = &s[0..4] == MAGIC && s[4..8] == FORMAT.to_le_bytes() && crc == crc32c::crc32c(&s[..40]);
    (whole && word(1) > 0).then(|| (word(0), word(1), Vote { term: word(2), vote: word(3) }))
}

/// A replica's raft state file fails it as a replication error.
impl From<VoteFileError> for ftvm_replication::ReplicationError {
    fn from(e: VoteFileError) -> Self {
        ftvm_replication::ReplicationError::RaftState(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ftvm-vote-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("raft.state")
    }

    #[test]
    fn the_last_vote_stored_is_read_back() {
        let path = scratch("back");
        let (mut f, read) = VoteFile::open(&path, 2).unwrap();
        assert_eq!(read, None, "a new file holds nothing");
        for (term, vote) in [(1, 1), (2, 0), (2, 3), (5, 2)] {
            f.store(Vote { term, vote }).unwrap();
            let (_, read) = VoteFile::open(&path, 2).unwrap();
            assert_eq!(read, Some(Vote { term, vote }));
        }
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_torn_write_leaves_the_previous_vote() {
        let path = scratch("torn");
        let (mut f, _) = VoteFile::open(&path, 1).unwrap();
        f.store(Vote { term: 3, vote: 1 }).unwrap();
        f.store(Vote { term: 4, vote: 2 }).unwrap();
        // The newer slot (seq 2: the first) half written.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[20] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let (mut f, read) = VoteFile::open(&path, 1).unwrap();
        assert_eq!(read, Some(Vote { term: 3, vote: 1 }));
        // The next write takes the torn slot; the whole one stays.
        f.store(Vote { term: 6, vote: 3 }).unwrap();
        assert_eq!(VoteFile::open(&path, 1).unwrap().1, Some(Vote { term: 6, vote: 3 }));
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn garbage_and_another_replicas_file_are_refused() {
        let path = scratch("bad");
        std::fs::write(&path, b"not a raft state file at all, just some text....").unwrap();
        let err = VoteFile::open(&path, 1).err().unwrap();
        assert!(matches!(err, VoteFileError::Corrupt { .. }), "{err}");
        std::fs::remove_file(&path).unwrap();
        VoteFile::open(&path, 3).unwrap().0.store(Vote { term: 1, vote: 3 }).unwrap();
        let err = VoteFile::open(&path, 1).err().unwrap();
        assert!(err.to_string().contains("belongs to replica 3, not to replica 1"), "{err}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
