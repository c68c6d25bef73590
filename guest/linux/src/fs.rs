//! The file system: a tree in memory with what programs expect to find
//! (`/dev/null`, `/dev/zero`, `/dev/urandom`, `/tmp`), created at boot,
//! the files of the root file system image the VMM placed in memory
//! (`ftvm run --rootfs`, [`ftvm_abi::rootfs`]) served in place, and with
//! `disk=PATH` the virtio-blk disk's file system mounted at PATH
//! ([`disk`](crate::disk)).
//!
//! A file of the image is read where it lies; the first write to it (or a
//! truncation) copies it into a file of the tree, as an overlay would, so
//! the image itself is never changed.
//!
//! Inode numbers name both: the disk's nodes are numbered from
//! [`DISK_INO`] up (the disk's root, the mount point, is `DISK_INO`
//! itself), so descriptors and the system calls never need to know which
//! file system a file lives on.

use alloc::collections::BTreeMap;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use ftvm_abi::rootfs;
use ftvm_diskfs::{Kind, NodeId};
use spin::Mutex;

use crate::disk;
use crate::errno::*;
use crate::filedata::FileData;
use crate::options::Options;

pub type Ino = u32;

/// The disk's node `n` is inode `DISK_INO + n`.
const DISK_INO: Ino = 0x8000_0000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dev {
    Null,
    Zero,
    Random,
}

enum Node {
    Dir(BTreeMap<String, Ino>),
    File(FileData),
    /// A file of the root file system image, with its permission bits.
    Image(&'static [u8], u32),
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

/// What an inode is, on either file system.
#[derive(Clone, Copy, PartialEq, Eq)]
enum What {
    Dir,
    File,
    Dev(Dev),
}

struct Fs {
    inodes: BTreeMap<Ino, Inode>,
    next: Ino,
    cwd: String,
    disk: Option<disk::Fs>,
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

fn on_disk(ino: Ino) -> Option<NodeId> {
    ino.checked_sub(DISK_INO)
}

fn now() -> u64 {
    crate::sys::time::realtime_ns()
}

pub fn init(opts: &Options, image: Option<&rootfs::Archive<'static>>) -> Result<(), String> {
    let mut fs = Fs { inodes: BTreeMap::new(), next: ROOT + 1, cwd: "/".into(), disk: None };
    fs.inodes.insert(ROOT, Inode { node: Node::Dir(BTreeMap::new()), links: 1, opens: 0, mtime_ns: 0 });
    for dir in ["/dev", "/tmp", "/etc", "/data"] {
        fs.mkdir(dir).map_err(|e| alloc::format!("mkdir {dir}: errno {e}"))?;
    }
    for (path, dev) in [("/dev/null", Dev::Null), ("/dev/zero", Dev::Zero), ("/dev/urandom", Dev::Random), ("/dev/random", Dev::Random)] {
        let (parent, name) = fs.parent_of(path).expect("absolute path");
        let ino = fs.alloc(Node::Dev(dev));
        fs.link(parent, &name, ino);
    }
    if let Some(image) = image {
        fs.add_image(image)?;
    }
    if let Some(path) = &opts.disk {
        fs.mount(path)?;
    }
    if let Some(cwd) = opts.cwd.as_ref().or(opts.disk.as_ref()) {
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
    /// Add the image's directories and files to the tree (directories come
    /// before what they hold).
    fn add_image(&mut self, image: &rootfs::Archive<'static>) -> Result<(), String> {
        for e in image.entries() {
            let (parent, name) = self.parent_of(e.path).map_err(|err| alloc::format!("root file system: {}: errno {err}", e.path))?;
            match e.kind {
                rootfs::Kind::Dir => match self.mkdir(e.path) {
                    Ok(()) | Err(EEXIST) => {}
                    Err(err) => return Err(alloc::format!("root file system: mkdir {}: errno {err}", e.path)),
                },
                rootfs::Kind::File => {
                    self.unlink_entry(parent, &name);
                    let ino = self.alloc(Node::Image(e.data, e.mode));
                    self.link(parent, &name, ino);
                }
            }
        }
        Ok(())
    }

    /// Before a file of the image changes: make it a file of the tree.
    fn copy_up(&mut self, ino: Ino) -> Result<(), Errno> {
        if let Some(inode) = self.inodes.get_mut(&ino) {
            if let Node::Image(data, _) = inode.node {
                inode.node = Node::File(FileData::from_slice(data)?);
            }
        }
        Ok(())
    }

    /// Mount the disk at `path` (a directory in memory, made if absent,
    /// whose entry then names the disk's root).
    fn mount(&mut self, path: &str) -> Result<(), String> {
        let parts = absolute("/", path);
        if parts.is_empty() {
            return Err("disk=/: the disk cannot be the root; mount it at a directory such as /data".into());
        }
        let mut at = String::new();
        for p in &parts[..parts.len() - 1] {
            at = alloc::format!("{at}/{p}");
            match self.mkdir(&at) {
                Ok(()) | Err(EEXIST) => {}
                Err(e) => return Err(alloc::format!("disk={path}: mkdir {at}: errno {e}")),
            }
        }
        let (parent, name) = self.parent_of(path).map_err(|e| alloc::format!("disk={path}: errno {e}"))?;
        self.disk = Some(disk::mount(path)?);
        self.unlink_entry(parent, &name);
        self.link(parent, &name, DISK_INO);
        Ok(())
    }

    fn disk(&mut self) -> &mut disk::Fs {
        self.disk.as_mut().expect("disk inodes exist only with a disk")
    }

    fn alloc(&mut self, node: Node) -> Ino {
        let ino = self.next;
        self.next += 1;
        self.inodes.insert(ino, Inode { node, links: 0, opens: 0, mtime_ns: now() });
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

    fn what(&self, ino: Ino) -> Option<What> {
        if let Some(id) = on_disk(ino) {
            return Some(match self.disk.as_ref()?.stat(id)?.kind {
                Kind::Dir => What::Dir,
                Kind::File => What::File,
            });
        }
        Some(match self.inodes.get(&ino)?.node {
            Node::Dir(_) => What::Dir,
            Node::File(_) | Node::Image(..) => What::File,
            Node::Dev(d) => What::Dev(d),
        })
    }

    fn child(&self, dir: Ino, name: &str) -> Result<Ino, Errno> {
        if let Some(id) = on_disk(dir) {
            let disk = self.disk.as_ref().ok_or(ENOENT)?;
            return disk.lookup(id, name).map(|n| DISK_INO + n).map_err(disk::errno);
        }
        match &self.inodes.get(&dir).ok_or(ENOENT)?.node {
            Node::Dir(entries) => entries.get(name).copied().ok_or(ENOENT),
            _ => Err(ENOTDIR),
        }
    }

    fn lookup_parts(&self, parts: &[String]) -> Result<Ino, Errno> {
        let mut at = ROOT;
        for p in parts {
            at = self.child(at, p)?;
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
        match self.what(dir) {
            Some(What::Dir) => Ok((dir, name)),
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
        if let Some(id) = on_disk(parent) {
            return self.disk().create(id, &name, Kind::Dir, now()).map(|_| ()).map_err(disk::errno);
        }
        if self.entries(parent).contains_key(&name) {
            return Err(EEXIST);
        }
        let ino = self.alloc(Node::Dir(BTreeMap::new()));
        self.link(parent, &name, ino);
        Ok(())
    }

    fn chdir(&mut self, path: &str) -> Result<(), Errno> {
        let ino = self.lookup(path)?;
        if self.what(ino) != Some(What::Dir) {
            return Err(ENOTDIR);
        }
        let parts = absolute(&self.cwd, path);
        self.cwd = alloc::format!("/{}", parts.join("/"));
        Ok(())
    }

    fn unlink_entry(&mut self, dir: Ino, name: &str) {
        if let Some(ino) = self.entries(dir).remove(name) {
            let Some(i) = self.inodes.get_mut(&ino) else { return };
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
                if let Some(id) = on_disk(parent) {
                    DISK_INO + fs.disk().create(id, &name, Kind::File, now()).map_err(disk::errno)?
                } else {
                    let ino = fs.alloc(Node::File(FileData::default()));
                    fs.link(parent, &name, ino);
                    ino
                }
            }
            Err(e) => return Err(e),
        };
        match fs.what(ino).ok_or(ENOENT)? {
            What::Dir => return Ok(Opened::Dir(ino)),
            What::Dev(d) => return Ok(Opened::Dev(d)),
            What::File => {}
        }
        if let Some(id) = on_disk(ino) {
            let disk = fs.disk();
            if truncate {
                disk.truncate(id, 0, now()).map_err(disk::errno)?;
            }
            disk.open(id);
        } else {
            if truncate {
                fs.copy_up(ino)?;
            }
            let inode = fs.inodes.get_mut(&ino).expect("looked up");
            if let Node::File(data) = &mut inode.node {
                if truncate {
                    data.truncate(0)?;
                    inode.mtime_ns = now();
                }
            }
            inode.opens += 1;
        }
        Ok(Opened::File(ino))
    })
}

/// An open description of `ino` is gone.
pub fn release(ino: Ino) {
    with(|fs| {
        if let Some(id) = on_disk(ino) {
            return fs.disk().release(id);
        }
        if let Some(i) = fs.inodes.get_mut(&ino) {
            i.opens -= 1;
            if i.opens == 0 && i.links == 0 {
                fs.inodes.remove(&ino);
            }
        }
    })
}

pub fn read_at(ino: Ino, offset: u64, out: &mut [u8]) -> Result<usize, Errno> {
    with(|fs| {
        if let Some(id) = on_disk(ino) {
            return fs.disk().read(id, offset, out).map_err(disk::errno);
        }
        Ok(match fs.inodes.get(&ino).map(|i| &i.node) {
            Some(Node::File(data)) => data.read(offset as usize, out),
            Some(Node::Image(data, _)) => read_slice(data, offset, out),
            _ => 0,
        })
    })
}

fn read_slice(data: &[u8], offset: u64, out: &mut [u8]) -> usize {
    let start = (offset as usize).min(data.len());
    let n = out.len().min(data.len() - start);
    out[..n].copy_from_slice(&data[start..start + n]);
    n
}

/// Write at `offset` (None: at the end); the bytes written and the offset
/// after them.
pub fn write_at(ino: Ino, offset: Option<u64>, bytes: &[u8]) -> Result<(usize, u64), Errno> {
    with(|fs| {
        if let Some(id) = on_disk(ino) {
            let disk = fs.disk();
            let at = match offset {
                Some(o) => o,
                None => disk.stat(id).ok_or(EBADF)?.size,
            };
            disk.write(id, at, bytes, now()).map_err(disk::errno)?;
            return Ok((bytes.len(), at + bytes.len() as u64));
        }
        fs.copy_up(ino)?;
        let inode = fs.inodes.get_mut(&ino).ok_or(EBADF)?;
        let Node::File(data) = &mut inode.node else { return Err(EBADF) };
        let at = offset.map_or(data.len(), |o| o as usize);
        data.write(at, bytes)?;
        inode.mtime_ns = now();
        Ok((bytes.len(), (at + bytes.len()) as u64))
    })
}

pub fn truncate(ino: Ino, len: u64) -> Result<(), Errno> {
    with(|fs| {
        if let Some(id) = on_disk(ino) {
            return fs.disk().truncate(id, len, now()).map_err(disk::errno);
        }
        fs.copy_up(ino)?;
        let inode = fs.inodes.get_mut(&ino).ok_or(EBADF)?;
        let Node::File(data) = &mut inode.node else { return Err(EINVAL) };
        data.truncate(len as usize)
    })
}

/// fsync/fdatasync: the file's data and size on the disk (files in memory
/// have nowhere to go).
pub fn sync(ino: Ino) -> Result<(), Errno> {
    with(|fs| match on_disk(ino) {
        Some(id) if fs.what(ino) == Some(What::File) => fs.disk().sync(id).map_err(disk::errno),
        _ => Ok(()),
    })
}

/// sync(2), and the program's exit: everything written reaches the disk.
pub fn sync_all() -> Result<(), Errno> {
    with(|fs| match fs.disk.as_mut() {
        Some(disk) => disk.sync_all().map_err(disk::errno),
        None => Ok(()),
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
        if let Some(id) = on_disk(ino) {
            let st = fs.disk.as_ref()?.stat(id)?;
            let mode = match st.kind {
                Kind::Dir => S_IFDIR | 0o755,
                Kind::File => S_IFREG | 0o644,
            };
            return Some(Stat { mode, size: st.size, ino: ino.into(), nlink: 1, mtime_ns: st.mtime_ns });
        }
        let i = fs.inodes.get(&ino)?;
        let (mode, size) = match &i.node {
            Node::Dir(e) => (S_IFDIR | 0o755, e.len() as u64),
            Node::File(d) => (S_IFREG | 0o644, d.len() as u64),
            Node::Image(d, mode) => (S_IFREG | mode, d.len() as u64),
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
        let ino = fs.child(parent, &name)?;
        if ino == DISK_INO {
            return Err(EBUSY);
        }
        if let Some(id) = on_disk(parent) {
            return fs.disk().remove(id, &name, dir, now()).map_err(disk::errno);
        }
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
        let ino = fs.child(fp, &fname)?;
        let (tp, tname) = fs.parent_of(to)?;
        if ino == DISK_INO || fs.child(tp, &tname) == Ok(DISK_INO) {
            return Err(EBUSY);
        }
        match (on_disk(fp), on_disk(tp)) {
            (Some(f), Some(t)) => return fs.disk().rename(f, &fname, t, &tname, now()).map_err(disk::errno),
            (None, None) => {}
            _ => return Err(EXDEV),
        }
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

/// Names in a directory, for getdents64: (name, ino, d_type).
pub fn list(dir: Ino) -> Vec<(String, Ino, u8)> {
    const DT_CHR: u8 = 2;
    const DT_DIR: u8 = 4;
    const DT_REG: u8 = 8;
    with(|fs| {
        if let Some(id) = on_disk(dir) {
            let entries = fs.disk.as_ref().and_then(|d| d.list(id).ok()).unwrap_or_default();
            return entries.into_iter().map(|(n, i, k)| (n, DISK_INO + i, if k == Kind::Dir { DT_DIR } else { DT_REG })).collect();
        }
        match &fs.inodes.get(&dir).map(|i| &i.node) {
            Some(Node::Dir(e)) => e
                .iter()
                .map(|(n, &i)| {
                    let kind = match fs.what(i) {
                        Some(What::Dir) => DT_DIR,
                        Some(What::Dev(_)) => DT_CHR,
                        _ => DT_REG,
                    };
                    (n.clone(), i, kind)
                })
                .collect(),
            _ => Vec::new(),
        }
    })
}

/// The whole contents of the file at `path`: a file of the image in place,
/// any other one copied (the loader reads programs and interpreters so).
pub fn contents(path: &str) -> Result<alloc::borrow::Cow<'static, [u8]>, Errno> {
    use alloc::borrow::Cow;
    let ino = with(|fs| fs.lookup(path))?;
    match with(|fs| match fs.inodes.get(&ino).map(|i| &i.node) {
        Some(Node::Image(data, _)) => Some(*data),
        _ => None,
    }) {
        Some(data) => return Ok(Cow::Borrowed(data)),
        None if with(|fs| fs.what(ino)) != Some(What::File) => return Err(EACCES),
        None => {}
    }
    let mut out = alloc::vec![0u8; size(ino) as usize];
    let n = read_at(ino, 0, &mut out)?;
    out.truncate(n);
    Ok(Cow::Owned(out))
}
