//! ftvm-fs: a small crash-consistent file system on a block device, for the
//! Linux personality's persistent directory (`disk=PATH` on the guest
//! command line), `no_std` and tested on the host.
//!
//! Why its own format: the `fatfs` crate needs nightly in `no_std`, and the
//! `no_std` FAT crates know only 8.3 names; programs want names like
//! `appendonly.aof`. The format ([`format`], `docs/guest-abi.md`) is a
//! superblock, two metadata slots written alternately (a commit is one
//! metadata write: a crash leaves the previous commit), and data blocks.
//!
//! Durability follows Linux's rules, kept simple:
//! - names (create, remove, rename, mkdir) are committed at once;
//! - file data is written back, then the file's size and blocks committed,
//!   by [`DiskFs::sync`] (fsync, fdatasync), [`DiskFs::sync_all`] (sync,
//!   program exit) and when a file holds more than [`WRITEBACK_BLOCKS`]
//!   unwritten blocks; a crash before that loses the unwritten data, never
//!   the file system, and a file's committed size never covers unwritten
//!   blocks;
//! - data reaches the disk (FLUSH) before the commit naming it, and a
//!   commit is flushed before its call returns.
//!
//! File data is cached per block: written blocks stay in memory until
//! written back, then only a file's last block is kept (appends rewrite
//! it); reads fetch up to [`READAHEAD_BLOCKS`] blocks at a time.
#![no_std]

extern crate alloc;

pub mod format;
mod space;

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

pub use format::BLOCK;
use format::{Extent, Record, Super, META_HEADER, NAME_MAX};
use space::Space;

pub type NodeId = u32;
/// The mount point: the file system's root directory.
pub const ROOT: NodeId = 0;
/// A file with more unwritten blocks than this (8 MiB) is written back.
pub const WRITEBACK_BLOCKS: usize = 2048;
/// Blocks read ahead on a cache miss (128 KiB).
pub const READAHEAD_BLOCKS: u64 = 32;
/// Blocks a growing file takes beyond its need, at most (8 MiB): as much as
/// it has, so the number of extents grows with the log of the size.
const PREALLOC_MAX: u64 = 2048;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// The device failed a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoError;

/// A disk of [`BLOCK`]-byte blocks.
pub trait BlockDevice {
    /// Blocks on the device.
    fn blocks(&self) -> u64;
    /// Read `buf.len() / BLOCK` blocks from `block`.
    fn read(&mut self, block: u64, buf: &mut [u8]) -> Result<(), IoError>;
    /// Write `buf.len() / BLOCK` blocks at `block`.
    fn write(&mut self, block: u64, buf: &[u8]) -> Result<(), IoError>;
    /// Make every completed write durable.
    fn flush(&mut self) -> Result<(), IoError>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    Io,
    NoSpace,
    NotFound,
    Exists,
    NotDir,
    IsDir,
    NotEmpty,
    NameTooLong,
    /// A bad name (empty, `.`, `..`, with `/`) or a directory moved into
    /// itself.
    Invalid,
    /// The disk is too small to hold a file system.
    TooSmall,
    /// Block 0 is neither blank nor an ftvm-fs superblock: the disk holds
    /// something else, which is left alone.
    Foreign,
    Corrupt(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Error::Io => f.write_str("disk I/O error"),
            Error::NoSpace => f.write_str("no space left on the disk"),
            Error::NotFound => f.write_str("no such file or directory"),
            Error::Exists => f.write_str("file exists"),
            Error::NotDir => f.write_str("not a directory"),
            Error::IsDir => f.write_str("is a directory"),
            Error::NotEmpty => f.write_str("directory not empty"),
            Error::NameTooLong => f.write_str("name too long"),
            Error::Invalid => f.write_str("invalid argument"),
            Error::TooSmall => f.write_str("the disk is too small for a file system"),
            Error::Foreign => {
                f.write_str("the disk holds something other than an ftvm file system (its first block is not blank); not formatting it")
            }
            Error::Corrupt(what) => write!(f, "the file system is damaged: {what}"),
        }
    }
}

impl From<IoError> for Error {
    fn from(_: IoError) -> Self {
        Error::Io
    }
}

/// What [`DiskFs::stat`] says of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    pub kind: Kind,
    pub size: u64,
    pub mtime_ns: u64,
}

struct Cached {
    data: Box<[u8]>,
    dirty: bool,
}

struct Node {
    parent: NodeId,
    name: String,
    kind: Kind,
    mtime_ns: u64,
    /// In a directory (false once removed while open).
    linked: bool,
    opens: u32,
    children: BTreeMap<String, NodeId>,
    /// The file's size now.
    size: u64,
    /// The size as far as its data is on the disk: what a commit records.
    synced_size: u64,
    /// The file's blocks in file order (beyond its size: preallocated).
    extents: Vec<Extent>,
    cache: BTreeMap<u64, Cached>,
    dirty_blocks: usize,
}

impl Node {
    fn new(parent: NodeId, name: String, kind: Kind, mtime_ns: u64) -> Node {
        Node {
            parent,
            name,
            kind,
            mtime_ns,
            linked: true,
            opens: 0,
            children: BTreeMap::new(),
            size: 0,
            synced_size: 0,
            extents: Vec::new(),
            cache: BTreeMap::new(),
            dirty_blocks: 0,
        }
    }

    fn allocated(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }

    /// Blocks the file needs beyond those it has.
    fn shortfall(&self) -> u64 {
        blocks_for(self.size).saturating_sub(self.allocated())
    }

    /// The disk block holding the file's block `idx` and how many blocks
    /// follow it contiguously in the same extent.
    fn phys(&self, idx: u64) -> Option<(u64, u64)> {
        let mut at = 0;
        for e in &self.extents {
            if idx < at + e.len {
                return Some((e.start + idx - at, e.len - (idx - at)));
            }
            at += e.len;
        }
        None
    }

    fn record(&self, id: NodeId) -> Record {
        Record {
            id,
            parent: self.parent,
            name: self.name.clone(),
            kind: self.kind,
            mtime_ns: self.mtime_ns,
            size: self.synced_size,
            extents: self.extents.clone(),
        }
    }
}

fn blocks_for(size: u64) -> u64 {
    size.div_ceil(BLOCK as u64)
}

/// Blocks read ahead for one file, from `first`.
struct Window {
    id: NodeId,
    first: u64,
    data: Vec<u8>,
}

pub struct DiskFs<D: BlockDevice> {
    dev: D,
    sb: Super,
    /// The last durable commit's sequence number.
    seq: u64,
    nodes: BTreeMap<NodeId, Node>,
    next_id: NodeId,
    space: Space,
    /// Names or sizes changed since the last commit.
    meta_dirty: bool,
    window: Option<Window>,
}

impl<D: BlockDevice> DiskFs<D> {
    /// Mount the file system on `dev`, formatting it first if its block 0
    /// is blank (a new disk). Returns the file system and whether it was
    /// formatted.
    pub fn mount_or_format(mut dev: D, now_ns: u64) -> Result<(DiskFs<D>, bool), Error> {
        let mut block0 = vec![0u8; BLOCK];
        dev.read(0, &mut block0)?;
        let (sb, formatted) = match Super::decode(&block0, dev.blocks())? {
            Some(sb) => (sb, false),
            None => (Self::format(&mut dev)?, true),
        };
        let (seq, records) = Self::latest_commit(&mut dev, &sb)?;
        let mut fs =
            DiskFs { dev, sb, seq, nodes: BTreeMap::new(), next_id: ROOT + 1, space: Space::default(), meta_dirty: false, window: None };
        fs.nodes.insert(ROOT, Node::new(ROOT, String::new(), Kind::Dir, now_ns));
        fs.load(records)?;
        Ok((fs, formatted))
    }

    /// Write a new file system: both metadata slots empty, then the
    /// superblock (a crash before it leaves the disk blank).
    fn format(dev: &mut D) -> Result<Super, Error> {
        let sb = Super::for_device(dev.blocks())?;
        for seq in 0..2 {
            dev.write(sb.slot_start(seq), &format::encode_meta(seq, &[]))?;
        }
        dev.flush()?;
        dev.write(0, &sb.encode())?;
        dev.flush()?;
        Ok(sb)
    }

    fn latest_commit(dev: &mut D, sb: &Super) -> Result<(u64, Vec<Record>), Error> {
        let mut best: Option<(u64, Vec<Record>)> = None;
        for slot in 0..2 {
            let mut img = vec![0u8; BLOCK];
            dev.read(sb.slot_start(slot), &mut img)?;
            let Some((seq, len)) = format::meta_header(&img) else { continue };
            if seq % 2 != slot || len > sb.meta_capacity() {
                continue;
            }
            img.resize((META_HEADER + len).next_multiple_of(BLOCK), 0);
            if img.len() > BLOCK {
                dev.read(sb.slot_start(slot) + 1, &mut img[BLOCK..])?;
            }
            if let Some((seq, records)) = format::decode_meta(&img) {
                if best.as_ref().is_none_or(|(s, _)| seq > *s) {
                    best = Some((seq, records));
                }
            }
        }
        best.ok_or(Error::Corrupt("no valid metadata slot"))
    }

    /// Build the tree from a commit's records, checking everything a
    /// damaged or hostile disk could get wrong.
    fn load(&mut self, records: Vec<Record>) -> Result<(), Error> {
        let mut used = Vec::new();
        for r in &records {
            if r.id == ROOT || self.nodes.contains_key(&r.id) {
                return Err(Error::Corrupt("duplicate node id"));
            }
            check_name(&r.name).map_err(|_| Error::Corrupt("bad name"))?;
            let mut n = Node::new(r.parent, r.name.clone(), r.kind, r.mtime_ns);
            n.extents = r.extents.clone();
            for e in &n.extents {
                if e.len == 0 || e.start < self.sb.data_start() || e.start.checked_add(e.len).is_none_or(|end| end > self.sb.blocks) {
                    return Err(Error::Corrupt("extent outside the data area"));
                }
            }
            if r.kind == Kind::Dir && (!n.extents.is_empty() || r.size != 0) {
                return Err(Error::Corrupt("a directory with data"));
            }
            if blocks_for(r.size) > n.allocated() {
                return Err(Error::Corrupt("a file larger than its blocks"));
            }
            n.size = r.size;
            n.synced_size = r.size;
            used.extend_from_slice(&n.extents);
            self.nodes.insert(r.id, n);
            self.next_id = self.next_id.max(r.id.checked_add(1).ok_or(Error::Corrupt("node id"))?);
        }
        for r in &records {
            let parent = self.nodes.get_mut(&r.parent).ok_or(Error::Corrupt("a node without its directory"))?;
            if parent.kind != Kind::Dir || parent.children.insert(r.name.clone(), r.id).is_some() {
                return Err(Error::Corrupt("a name in no directory or twice in one"));
            }
        }
        // Every directory reaches the root (no cycles).
        for r in records.iter().filter(|r| r.kind == Kind::Dir) {
            let mut at = r.parent;
            let mut steps = 0;
            while at != ROOT {
                at = self.nodes[&at].parent;
                steps += 1;
                if steps > records.len() {
                    return Err(Error::Corrupt("a directory cycle"));
                }
            }
        }
        used.sort_by_key(|e| e.start);
        if used.windows(2).any(|w| w[0].start + w[0].len > w[1].start) {
            return Err(Error::Corrupt("blocks used twice"));
        }
        self.space = Space::new(self.sb.data_start(), self.sb.blocks, &mut used);
        Ok(())
    }

    fn node(&self, id: NodeId) -> Result<&Node, Error> {
        self.nodes.get(&id).ok_or(Error::NotFound)
    }

    fn node_mut(&mut self, id: NodeId) -> Result<&mut Node, Error> {
        self.nodes.get_mut(&id).ok_or(Error::NotFound)
    }

    fn dir(&self, id: NodeId) -> Result<&Node, Error> {
        let n = self.node(id)?;
        match n.kind {
            Kind::Dir if n.linked => Ok(n),
            Kind::Dir => Err(Error::NotFound),
            Kind::File => Err(Error::NotDir),
        }
    }

    fn file_mut(&mut self, id: NodeId) -> Result<&mut Node, Error> {
        let n = self.node_mut(id)?;
        match n.kind {
            Kind::File => Ok(n),
            Kind::Dir => Err(Error::IsDir),
        }
    }

    pub fn lookup(&self, dir: NodeId, name: &str) -> Result<NodeId, Error> {
        self.dir(dir)?.children.get(name).copied().ok_or(Error::NotFound)
    }

    pub fn stat(&self, id: NodeId) -> Option<Stat> {
        self.nodes.get(&id).map(|n| Stat { kind: n.kind, size: n.size, mtime_ns: n.mtime_ns })
    }

    /// A directory's entries: (name, node, kind).
    pub fn list(&self, dir: NodeId) -> Result<Vec<(String, NodeId, Kind)>, Error> {
        Ok(self.dir(dir)?.children.iter().map(|(name, &id)| (name.clone(), id, self.nodes[&id].kind)).collect())
    }

    /// Blocks free for data (what pending frees will add is not counted).
    pub fn free_blocks(&self) -> u64 {
        self.space.free_blocks().saturating_sub(self.reserved())
    }

    /// Blocks files need for data not yet given blocks.
    fn reserved(&self) -> u64 {
        self.nodes.values().map(Node::shortfall).sum()
    }

    /// Blocks file `id` may still take: free or pending (free after the
    /// next commit), less what the other files need.
    fn available_for(&self, id: NodeId) -> u64 {
        let others = self.reserved() - self.nodes[&id].shortfall();
        (self.space.free_blocks() + self.space.pending_blocks()).saturating_sub(others)
    }

    fn meta_len(&self) -> usize {
        4 + self.nodes.iter().filter(|(&id, n)| id != ROOT && n.linked).map(|(&id, n)| n.record(id).encoded_len()).sum::<usize>()
    }

    /// Make `name` in `dir` (committed before this returns).
    pub fn create(&mut self, dir: NodeId, name: &str, kind: Kind, now_ns: u64) -> Result<NodeId, Error> {
        check_name(name)?;
        if self.dir(dir)?.children.contains_key(name) {
            return Err(Error::Exists);
        }
        if self.meta_len() + 34 + name.len() > self.sb.meta_capacity() {
            return Err(Error::NoSpace);
        }
        let id = self.next_id;
        self.next_id = id.checked_add(1).ok_or(Error::NoSpace)?;
        self.nodes.insert(id, Node::new(dir, name.to_string(), kind, now_ns));
        let d = self.node_mut(dir)?;
        d.children.insert(name.to_string(), id);
        d.mtime_ns = now_ns;
        self.commit()?;
        Ok(id)
    }

    /// Remove `name` from `dir` (committed before this returns); an open
    /// file lives on until [`release`](Self::release)d.
    pub fn remove(&mut self, dir: NodeId, name: &str, want_dir: bool, now_ns: u64) -> Result<(), Error> {
        let id = self.lookup(dir, name)?;
        let n = self.node(id)?;
        match (n.kind, want_dir) {
            (Kind::Dir, true) if !n.children.is_empty() => return Err(Error::NotEmpty),
            (Kind::Dir, false) => return Err(Error::IsDir),
            (Kind::File, true) => return Err(Error::NotDir),
            _ => {}
        }
        self.unlink(dir, name, now_ns);
        self.commit()
    }

    /// Take `name` out of `dir`, dropping its node if nothing has it open.
    fn unlink(&mut self, dir: NodeId, name: &str, now_ns: u64) {
        let Some(d) = self.nodes.get_mut(&dir) else { return };
        let Some(id) = d.children.remove(name) else { return };
        d.mtime_ns = now_ns;
        let n = self.nodes.get_mut(&id).expect("a linked node exists");
        n.linked = false;
        if n.opens == 0 {
            self.drop_node(id);
        }
    }

    fn drop_node(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.remove(&id) {
            for e in n.extents {
                self.space.release(e);
            }
            if self.window.as_ref().is_some_and(|w| w.id == id) {
                self.window = None;
            }
        }
    }

    /// Move `from_name` in `from_dir` to `to_name` in `to_dir`, replacing
    /// what is there as rename(2) does (committed before this returns).
    pub fn rename(&mut self, from_dir: NodeId, from_name: &str, to_dir: NodeId, to_name: &str, now_ns: u64) -> Result<(), Error> {
        check_name(to_name)?;
        let id = self.lookup(from_dir, from_name)?;
        let kind = self.node(id)?.kind;
        self.dir(to_dir)?;
        if let Ok(old) = self.lookup(to_dir, to_name) {
            if old == id {
                return Ok(());
            }
            let o = self.node(old)?;
            match (kind, o.kind) {
                (Kind::File, Kind::Dir) => return Err(Error::IsDir),
                (Kind::Dir, Kind::File) => return Err(Error::NotDir),
                (Kind::Dir, Kind::Dir) if !o.children.is_empty() => return Err(Error::NotEmpty),
                _ => {}
            }
        }
        if kind == Kind::Dir {
            // Not into itself or below.
            let mut at = to_dir;
            loop {
                if at == id {
                    return Err(Error::Invalid);
                }
                if at == ROOT {
                    break;
                }
                at = self.node(at)?.parent;
            }
        }
        let grows = to_name.len().saturating_sub(from_name.len());
        if self.meta_len() + grows > self.sb.meta_capacity() {
            return Err(Error::NoSpace);
        }
        self.unlink(to_dir, to_name, now_ns);
        let from = self.node_mut(from_dir)?;
        from.children.remove(from_name);
        from.mtime_ns = now_ns;
        let to = self.node_mut(to_dir)?;
        to.children.insert(to_name.to_string(), id);
        to.mtime_ns = now_ns;
        let n = self.node_mut(id)?;
        n.parent = to_dir;
        n.name = to_name.to_string();
        self.commit()
    }

    /// A descriptor of `id` was opened.
    pub fn open(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get_mut(&id) {
            n.opens += 1;
        }
    }

    /// A descriptor of `id` is gone; a removed file with no descriptor
    /// left is dropped.
    pub fn release(&mut self, id: NodeId) {
        let Some(n) = self.nodes.get_mut(&id) else { return };
        n.opens = n.opens.saturating_sub(1);
        if n.opens == 0 && !n.linked {
            self.drop_node(id);
        }
    }

    /// Read from `offset`; 0 at or past the end.
    pub fn read(&mut self, id: NodeId, offset: u64, buf: &mut [u8]) -> Result<usize, Error> {
        let size = self.file_mut(id)?.size;
        if offset >= size {
            return Ok(0);
        }
        let n = buf.len().min((size - offset) as usize);
        let mut done = 0;
        while done < n {
            let pos = offset + done as u64;
            let (idx, within) = (pos / BLOCK as u64, (pos % BLOCK as u64) as usize);
            let take = (BLOCK - within).min(n - done);
            let out = &mut buf[done..done + take];
            if let Some(c) = self.nodes[&id].cache.get(&idx) {
                out.copy_from_slice(&c.data[within..within + take]);
            } else {
                let data = self.block_from_disk(id, idx)?;
                out.copy_from_slice(&data[within..within + take]);
            }
            done += take;
        }
        Ok(n)
    }

    /// The committed content of the file's block `idx` (not cached), read
    /// ahead through the window; zero where the file has no data.
    fn block_from_disk(&mut self, id: NodeId, idx: u64) -> Result<&[u8], Error> {
        let hit = self.window.as_ref().is_some_and(|w| w.id == id && idx >= w.first && idx < w.first + (w.data.len() / BLOCK) as u64);
        if !hit {
            let n = &self.nodes[&id];
            let data = match n.phys(idx) {
                Some((phys, run)) if idx < blocks_for(n.size) => {
                    let count = run.min(READAHEAD_BLOCKS).min(blocks_for(n.size) - idx);
                    let mut data = vec![0u8; count as usize * BLOCK];
                    self.dev.read(phys, &mut data)?;
                    data
                }
                _ => vec![0u8; BLOCK],
            };
            self.window = Some(Window { id, first: idx, data });
        }
        let w = self.window.as_ref().expect("window just filled");
        let at = (idx - w.first) as usize * BLOCK;
        Ok(&w.data[at..at + BLOCK])
    }

    /// Write `data` at `offset` (past the end: the gap reads as zeros).
    pub fn write(&mut self, id: NodeId, offset: u64, data: &[u8], now_ns: u64) -> Result<(), Error> {
        let end = offset.checked_add(data.len() as u64).ok_or(Error::NoSpace)?;
        let n = self.file_mut(id)?;
        let size = n.size;
        if data.is_empty() {
            return Ok(());
        }
        if end > size {
            let need = blocks_for(end).saturating_sub(n.allocated());
            if need > self.available_for(id) {
                return Err(Error::NoSpace);
            }
        }
        if offset > size {
            self.fill_zero(id, size, offset)?;
        }
        self.put(id, offset, data)?;
        let n = self.node_mut(id)?;
        n.size = n.size.max(end);
        n.mtime_ns = now_ns;
        if n.dirty_blocks > WRITEBACK_BLOCKS {
            self.sync(id)?;
        }
        Ok(())
    }

    fn fill_zero(&mut self, id: NodeId, from: u64, to: u64) -> Result<(), Error> {
        let zeros = [0u8; BLOCK];
        let mut at = from;
        while at < to {
            let n = (to - at).min(BLOCK as u64 - at % BLOCK as u64);
            self.put(id, at, &zeros[..n as usize])?;
            at += n;
        }
        self.node_mut(id)?.size = self.nodes[&id].size.max(to);
        Ok(())
    }

    /// Copy `data` into the file's cached blocks, marking them dirty.
    fn put(&mut self, id: NodeId, offset: u64, data: &[u8]) -> Result<(), Error> {
        let mut done = 0;
        while done < data.len() {
            let pos = offset + done as u64;
            let (idx, within) = (pos / BLOCK as u64, (pos % BLOCK as u64) as usize);
            let take = (BLOCK - within).min(data.len() - done);
            let n = &self.nodes[&id];
            if !n.cache.contains_key(&idx) {
                // A partly written block starts from its content; blocks at
                // or past the end start from zeros (their disk blocks, if
                // preallocated, hold anything).
                let block: Box<[u8]> = if take == BLOCK || idx * BLOCK as u64 >= n.size {
                    vec![0u8; BLOCK].into()
                } else {
                    self.block_from_disk(id, idx)?.into()
                };
                self.node_mut(id)?.cache.insert(idx, Cached { data: block, dirty: false });
            }
            let n = self.node_mut(id)?;
            let c = n.cache.get_mut(&idx).expect("inserted above");
            c.data[within..within + take].copy_from_slice(&data[done..done + take]);
            if !c.dirty {
                c.dirty = true;
                n.dirty_blocks += 1;
            }
            done += take;
        }
        Ok(())
    }

    /// Set the file's size (longer: zeros; shorter: blocks past the end are
    /// given back).
    pub fn truncate(&mut self, id: NodeId, len: u64, now_ns: u64) -> Result<(), Error> {
        let size = self.file_mut(id)?.size;
        if len > size {
            let n = &self.nodes[&id];
            let need = blocks_for(len).saturating_sub(n.allocated());
            if need > self.available_for(id) {
                return Err(Error::NoSpace);
            }
            self.fill_zero(id, size, len)?;
        } else if len < size {
            let keep = blocks_for(len);
            let n = self.node_mut(id)?;
            n.size = len;
            n.synced_size = n.synced_size.min(len);
            let dropped = n.cache.split_off(&keep);
            n.dirty_blocks -= dropped.values().filter(|c| c.dirty).count();
            let mut freed = Vec::new();
            let mut at = 0;
            n.extents.retain_mut(|e| {
                let keep_here = keep.saturating_sub(at).min(e.len);
                at += e.len;
                if keep_here < e.len {
                    freed.push(Extent { start: e.start + keep_here, len: e.len - keep_here });
                    e.len = keep_here;
                }
                e.len > 0
            });
            for e in freed {
                self.space.release(e);
            }
            self.meta_dirty = true;
            if self.window.as_ref().is_some_and(|w| w.id == id) {
                self.window = None;
            }
        }
        self.node_mut(id)?.mtime_ns = now_ns;
        Ok(())
    }

    /// Give the file blocks up to `target`, growing its last extent in
    /// place where the disk allows, with some preallocation.
    fn allocate(&mut self, id: NodeId, target: u64) -> Result<(), Error> {
        let n = &self.nodes[&id];
        let have = n.allocated();
        if have >= target {
            return Ok(());
        }
        let grow = target - have;
        let avail = self.space.free_blocks().saturating_sub(self.reserved() - n.shortfall());
        if avail < grow {
            return Err(Error::NoSpace);
        }
        let mut want = grow + have.min(PREALLOC_MAX).min(avail - grow);
        let last_end = n.extents.last().map(|e| e.start + e.len);
        let mut got = Vec::new();
        if let Some(end) = last_end {
            let k = self.space.take_at(end, want);
            if k > 0 {
                got.push(Extent { start: end, len: k });
                want -= k;
            }
        }
        let mut have_now = have + got.iter().map(|e| e.len).sum::<u64>();
        while have_now < target {
            let e = self.space.take(1, want).ok_or(Error::NoSpace)?;
            want -= e.len;
            have_now += e.len;
            got.push(e);
        }
        let n = self.node_mut(id)?;
        for e in got {
            match n.extents.last_mut() {
                Some(last) if last.start + last.len == e.start => last.len += e.len,
                _ => n.extents.push(e),
            }
        }
        Ok(())
    }

    /// Write the file's dirty blocks; whether anything was written.
    fn write_back(&mut self, id: NodeId) -> Result<bool, Error> {
        let n = &self.nodes[&id];
        if n.dirty_blocks == 0 {
            return Ok(false);
        }
        let target = blocks_for(self.nodes[&id].size);
        match self.allocate(id, target) {
            Err(Error::NoSpace) if self.space.pending_blocks() > 0 => {
                // Blocks freed since the last commit become usable once a
                // commit no longer names them.
                self.commit()?;
                self.allocate(id, target)?;
            }
            r => r?,
        }
        let n = &self.nodes[&id];
        let dirty: Vec<u64> = n.cache.iter().filter(|(_, c)| c.dirty).map(|(&i, _)| i).collect();
        let mut i = 0;
        while i < dirty.len() {
            let (phys, run) = n.phys(dirty[i]).ok_or(Error::Corrupt("a dirty block without a disk block"))?;
            let mut buf = Vec::new();
            let mut j = i;
            while j < dirty.len() && dirty[j] - dirty[i] < run && dirty[j] - dirty[i] == (j - i) as u64 {
                buf.extend_from_slice(&n.cache[&dirty[j]].data);
                j += 1;
            }
            self.dev.write(phys, &buf)?;
            i = j;
        }
        let n = self.node_mut(id)?;
        let last = blocks_for(n.size).checked_sub(1);
        n.cache.retain(|&idx, _| Some(idx) == last);
        for c in n.cache.values_mut() {
            c.dirty = false;
        }
        n.dirty_blocks = 0;
        if self.window.as_ref().is_some_and(|w| w.id == id) {
            self.window = None;
        }
        Ok(true)
    }

    /// fsync: the file's data, then its size and blocks, on the disk.
    pub fn sync(&mut self, id: NodeId) -> Result<(), Error> {
        self.file_mut(id)?;
        if self.write_back(id)? {
            self.dev.flush()?;
        }
        self.size_synced(id)?;
        self.commit_if_dirty()
    }

    /// sync(2): every file's data and the metadata.
    pub fn sync_all(&mut self) -> Result<(), Error> {
        let ids: Vec<NodeId> = self.nodes.iter().filter(|(_, n)| n.kind == Kind::File).map(|(&id, _)| id).collect();
        let mut wrote = false;
        for &id in &ids {
            wrote |= self.write_back(id)?;
        }
        if wrote {
            self.dev.flush()?;
        }
        for id in ids {
            self.size_synced(id)?;
        }
        self.commit_if_dirty()
    }

    /// The file's data is on the disk: its size goes into the next commit.
    fn size_synced(&mut self, id: NodeId) -> Result<(), Error> {
        let n = self.node_mut(id)?;
        if n.synced_size != n.size {
            n.synced_size = n.size;
            self.meta_dirty = true;
        }
        Ok(())
    }

    fn commit_if_dirty(&mut self) -> Result<(), Error> {
        if self.meta_dirty {
            self.commit()?;
        }
        Ok(())
    }

    /// Write all metadata as commit `seq + 1` into its slot and flush.
    fn commit(&mut self) -> Result<(), Error> {
        let records: Vec<Record> = self.nodes.iter().filter(|(&id, n)| id != ROOT && n.linked).map(|(&id, n)| n.record(id)).collect();
        let seq = self.seq + 1;
        let img = format::encode_meta(seq, &records);
        if img.len() > self.sb.meta_blocks as usize * BLOCK {
            self.meta_dirty = true;
            return Err(Error::NoSpace);
        }
        self.meta_dirty = true;
        self.dev.write(self.sb.slot_start(seq % 2), &img)?;
        self.dev.flush()?;
        self.seq = seq;
        self.meta_dirty = false;
        self.space.committed();
        Ok(())
    }

    /// The device, for tests.
    pub fn device(&mut self) -> &mut D {
        &mut self.dev
    }
}

fn check_name(name: &str) -> Result<(), Error> {
    if name.len() > NAME_MAX {
        return Err(Error::NameTooLong);
    }
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(Error::Invalid);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
