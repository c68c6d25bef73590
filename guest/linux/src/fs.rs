//! The file system: a tree in memory with what programs expect to find
//! (`/dev/null`, `/dev/zero`, `/dev/urandom`, `/tmp`), created at boot.

use alloc::collections::BTreeMap;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use spin::Mutex;

use crate::errno::*;
use crate::options::Options;

pub type Ino = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dev {
    Null,
    Zero,
    Random,
}

enum Node {
    Dir(BTreeMap<String, Ino>),
    File(Vec<u8>),
    Dev(Dev),
}

struct Inode {
    node: Node,
    /// Directory entries naming it.
    links: u32,
    /// Open file descriptions of it.
    opens: u32,
    mtime_ns: u64,
}

struct Fs {
    inodes: BTreeMap<Ino, Inode>,
    next: Ino,
    cwd: String,
}

const ROOT: Ino = 1;

pub const S_IFREG: u32 = 0o100000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFIFO: u32 = 0o010000;
pub const S_IFSOCK: u32 = 0o140000;

static FS: Mutex<Option<Fs>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut Fs) -> R) -> R {
    f(FS.lock().as_mut().expect("fs initialised"))
}

pub fn init(opts: &Options) -> Result<(), String> {
    if opts.disk.is_some() {
        return Err("disk= is not supported yet: files live in memory only".into());
    }
    let mut fs = Fs { inodes: BTreeMap::new(), next: ROOT + 1, cwd: "/".into() };
    fs.inodes.insert(ROOT, Inode { node: Node::Dir(BTreeMap::new()), links: 1, opens: 0, mtime_ns: 0 });
    for dir in ["/dev", "/tmp", "/etc", "/data"] {
        fs.mkdir(dir).map_err(|e| alloc::format!("mkdir {dir}: errno {e}"))?;
    }
    for (path, dev) in [("/dev/null", Dev::Null), ("/dev/zero", Dev::Zero), ("/dev/urandom", Dev::Random), ("/dev/random", Dev::Random)] {
        let (parent, name) = fs.parent_of(path).expect("absolute path");
        let ino = fs.alloc(Node::Dev(dev));
        fs.link(parent, &name, ino);
    }
    if let Some(cwd) = &opts.cwd {
        fs.chdir(cwd).map_err(|e| alloc::format!("cwd={cwd}: errno {e}"))?;
    }
    *FS.lock() = Some(fs);
    Ok(())
}

/// `path` made absolute and normalised (no `.`, `..` or empty components).
fn absolute(cwd: &str, path: &str) -> Vec<String> {
    let mut parts: Vec<String> = Vec::new();
    let full = if path.starts_with('/') { path.to_string() } else { alloc::format!("{cwd}/{path}") };
    for c in full.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c.to_string()),
        }
    }
    parts
}

impl Fs {
    fn alloc(&mut self, node: Node) -> Ino {
        let ino = self.next;
        self.next += 1;
        self.inodes.insert(ino, Inode { node, links: 0, opens: 0, mtime_ns: crate::sys::time::realtime_ns() });
        ino
    }

    fn link(&mut self, dir: Ino, name: &str, ino: Ino) {
        if let Some(Node::Dir(entries)) = self.inodes.get_mut(&dir).map(|i| &mut i.node) {
            entries.insert(name.to_string(), ino);
        }
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.links += 1;
        }
    }

    fn lookup_parts(&self, parts: &[String]) -> Result<Ino, Errno> {
        let mut at = ROOT;
        for p in parts {
            match &self.inodes[&at].node {
                Node::Dir(entries) => at = *entries.get(p).ok_or(ENOENT)?,
                _ => return Err(ENOTDIR),
            }
        }
        Ok(at)
    }

    fn lookup(&self, path: &str) -> Result<Ino, Errno> {
        if path.is_empty() {
            return Err(ENOENT);
        }
        self.lookup_parts(&absolute(&self.cwd, path))
    }

    /// The directory that holds `path`'s last component, and that component.
    fn parent_of(&self, path: &str) -> Result<(Ino, String), Errno> {
        let mut parts = absolute(&self.cwd, path);
        let name = parts.pop().ok_or(EEXIST)?;
        if name.len() > 255 {
            return Err(ENAMETOOLONG);
        }
        let dir = self.lookup_parts(&parts)?;
        match self.inodes[&dir].node {
            Node::Dir(_) => Ok((dir, name)),
            _ => Err(ENOTDIR),
        }
    }

    fn entries(&mut self, dir: Ino) -> &mut BTreeMap<String, Ino> {
        match &mut self.inodes.get_mut(&dir).expect("directory exists").node {
            Node::Dir(e) => e,
            _ => unreachable!("parent_of returns directories"),
        }
    }

    fn mkdir(&mut self, path: &str) -> Result<(), Errno> {
        let (parent, name) = self.parent_of(path)?;
        if self.entries(parent).contains_key(&name) {
            return Err(EEXIST);
        }
        let ino = self.alloc(Node::Dir(BTreeMap::new()));
        self.link(parent, &name, ino);
        Ok(())
    }

    fn chdir(&mut self, path: &str) -> Result<(), Errno> {
        let ino = self.lookup(path)?;
        if !matches!(self.inodes[&ino].node, Node::Dir(_)) {
            return Err(ENOTDIR);
        }
        let parts = absolute(&self.cwd, path);
        self.cwd = alloc::format!("/{}", parts.join("/"));
        Ok(())
    }

    fn unlink_entry(&mut self, dir: Ino, name: &str) {
        if let Some(ino) = self.entries(dir).remove(name) {
            let i = self.inodes.get_mut(&ino).expect("linked inode exists");
            i.links -= 1;
            if i.links == 0 && i.opens == 0 {
                self.inodes.remove(&ino);
            }
        }
    }
}

/// What `open` found or made.
pub enum Opened {
    File(Ino),
    Dir(Ino),
    Dev(Dev),
}

pub fn open(path: &str, create: bool, exclusive: bool, truncate: bool) -> Result<Opened, Errno> {
    with(|fs| {
        let ino = match fs.lookup(path) {
            Ok(_) if create && exclusive => return Err(EEXIST),
            Ok(ino) => ino,
            Err(ENOENT) if create => {
                let (parent, name) = fs.parent_of(path)?;
                let ino = fs.alloc(Node::File(Vec::new()));
                fs.link(parent, &name, ino);
                ino
            }
            Err(e) => return Err(e),
        };
        let now = crate::sys::time::realtime_ns();
        let inode = fs.inodes.get_mut(&ino).expect("looked up");
        match &mut inode.node {
            Node::Dir(_) => Ok(Opened::Dir(ino)),
            Node::Dev(d) => Ok(Opened::Dev(*d)),
            Node::File(data) => {
                if truncate {
                    data.clear();
                    inode.mtime_ns = now;
                }
                inode.opens += 1;
                Ok(Opened::File(ino))
            }
        }
    })
}

/// An open description of `ino` is gone.
pub fn release(ino: Ino) {
    with(|fs| {
        if let Some(i) = fs.inodes.get_mut(&ino) {
            i.opens -= 1;
            if i.opens == 0 && i.links == 0 {
                fs.inodes.remove(&ino);
            }
        }
    })
}

pub fn read_at(ino: Ino, offset: u64, out: &mut [u8]) -> usize {
    with(|fs| match fs.inodes.get(&ino).map(|i| &i.node) {
        Some(Node::File(data)) => {
            let start = (offset as usize).min(data.len());
            let n = out.len().min(data.len() - start);
            out[..n].copy_from_slice(&data[start..start + n]);
            n
        }
        _ => 0,
    })
}

pub fn write_at(ino: Ino, offset: Option<u64>, bytes: &[u8]) -> Result<(usize, u64), Errno> {
    with(|fs| {
        let now = crate::sys::time::realtime_ns();
        let inode = fs.inodes.get_mut(&ino).ok_or(EBADF)?;
        let Node::File(data) = &mut inode.node else { return Err(EBADF) };
        let at = offset.map_or(data.len(), |o| o as usize);
        let end = at.checked_add(bytes.len()).ok_or(ENOSPC)?;
        if data.len() < end {
            data.try_reserve(end - data.len()).map_err(|_| ENOSPC)?;
            data.resize(end, 0);
        }
        data[at..end].copy_from_slice(bytes);
        inode.mtime_ns = now;
        Ok((bytes.len(), end as u64))
    })
}

pub fn truncate(ino: Ino, len: u64) -> Result<(), Errno> {
    with(|fs| {
        let inode = fs.inodes.get_mut(&ino).ok_or(EBADF)?;
        let Node::File(data) = &mut inode.node else { return Err(EINVAL) };
        data.resize(len as usize, 0);
        Ok(())
    })
}

/// (mode, size, ino, nlink, mtime_ns) of an inode.
pub struct Stat {
    pub mode: u32,
    pub size: u64,
    pub ino: u64,
    pub nlink: u64,
    pub mtime_ns: u64,
}

pub fn stat_ino(ino: Ino) -> Option<Stat> {
    with(|fs| {
        let i = fs.inodes.get(&ino)?;
        let (mode, size) = match &i.node {
            Node::Dir(e) => (S_IFDIR | 0o755, e.len() as u64),
            Node::File(d) => (S_IFREG | 0o644, d.len() as u64),
            Node::Dev(_) => (S_IFCHR | 0o666, 0),
        };
        Some(Stat { mode, size, ino: ino.into(), nlink: i.links.into(), mtime_ns: i.mtime_ns })
    })
}

pub fn stat_path(path: &str) -> Result<Stat, Errno> {
    let ino = with(|fs| fs.lookup(path))?;
    stat_ino(ino).ok_or(ENOENT)
}

pub fn size(ino: Ino) -> u64 {
    stat_ino(ino).map_or(0, |s| s.size)
}

pub fn unlink(path: &str, dir: bool) -> Result<(), Errno> {
    with(|fs| {
        let (parent, name) = fs.parent_of(path)?;
        let ino = *fs.entries(parent).get(&name).ok_or(ENOENT)?;
        match (&fs.inodes[&ino].node, dir) {
            (Node::Dir(e), true) if !e.is_empty() => return Err(ENOTEMPTY),
            (Node::Dir(_), false) => return Err(EISDIR),
            (Node::Dir(_), true) => {}
            (_, true) => return Err(ENOTDIR),
            _ => {}
        }
        fs.unlink_entry(parent, &name);
        Ok(())
    })
}

pub fn mkdir(path: &str) -> Result<(), Errno> {
    with(|fs| fs.mkdir(path))
}

pub fn rename(from: &str, to: &str) -> Result<(), Errno> {
    with(|fs| {
        let (fp, fname) = fs.parent_of(from)?;
        let ino = *fs.entries(fp).get(&fname).ok_or(ENOENT)?;
        let (tp, tname) = fs.parent_of(to)?;
        if fs.entries(tp).get(&tname) == Some(&ino) {
            return Ok(());
        }
        fs.unlink_entry(tp, &tname);
        fs.entries(fp).remove(&fname);
        fs.entries(tp).insert(tname, ino);
        Ok(())
    })
}

pub fn chdir(path: &str) -> Result<(), Errno> {
    with(|fs| fs.chdir(path))
}

pub fn cwd() -> String {
    with(|fs| fs.cwd.clone())
}

/// Names in a directory, for getdents64: (name, ino, is_dir).
pub fn list(dir: Ino) -> Vec<(String, Ino, u8)> {
    with(|fs| match &fs.inodes.get(&dir).map(|i| &i.node) {
        Some(Node::Dir(e)) => e
            .iter()
            .map(|(n, &i)| {
                let kind = match fs.inodes[&i].node {
                    Node::Dir(_) => 4,
                    Node::File(_) => 8,
                    Node::Dev(_) => 2,
                };
                (n.clone(), i, kind)
            })
            .collect(),
        _ => Vec::new(),
    })
}
