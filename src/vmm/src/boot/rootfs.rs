//! Packing a host directory into a root file system image
//! ([`ftvm_abi::rootfs`]) that the VMM places in guest memory for the Linux
//! personality: the files a dynamically linked program needs (its
//! interpreter, libraries, `/etc` files), collected on the host by
//! `scripts/make-rootfs.sh`.
//!
//! An image in guest RAM rather than a file system on a virtio-blk disk:
//! the personality already keeps a file tree in memory, the disk is the
//! program's persistent directory (one per VM), and the files are read-only
//! and small (redis-server with its 17 libraries is about 16 MiB). Being
//! guest memory, the image reaches a backup with the first checkpoint like
//! any other page.
//!
//! Symbolic links are followed (a link becomes a copy of its target), so
//! the guest sees regular files and directories only.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use ftvm_abi::rootfs::{ENTRY_SIZE, HEADER_SIZE, KIND_DIR, KIND_FILE, MAGIC, VERSION};
use ftvm_abi::PAGE_SIZE;

/// Deepest directory nesting followed (a symbolic link loop ends here).
const MAX_DEPTH: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("root file system {dir}: {err}")]
    Read { dir: String, err: String },
    #[error("root file system {dir} is not a directory")]
    NotDir { dir: String },
    #[error("program {program} is not in the root file system {dir} (make one with scripts/make-rootfs.sh {program} {dir})")]
    NoProgram { program: String, dir: String },
    #[error("root file system {dir} is too large ({size} MiB)")]
    TooLarge { dir: String, size: u64 },
}

enum Item {
    Dir(u32),
    File(u32, PathBuf),
}

/// Where in `dir` the program `image` (a host path) is: the image's path
/// below `dir` if it lies there, else the same path inside `dir`
/// (`/usr/bin/redis-server` collected into `dir/usr/bin/redis-server`).
/// Paths are compared as written (made absolute, `.` and `..` resolved),
/// not by following links: a program's name is what its argv[0] says.
pub fn program_path(dir: &Path, image: &Path) -> Result<String, RootfsError> {
    check_dir(dir)?;
    let no = || RootfsError::NoProgram { program: image.display().to_string(), dir: dir.display().to_string() };
    let (dir_abs, image_abs) = (normal(dir).ok_or_else(no)?, normal(image).ok_or_else(no)?);
    let rel = match image_abs.strip_prefix(&dir_abs) {
        Ok(rel) => rel.to_path_buf(),
        Err(_) => image_abs.strip_prefix("/").map_err(|_| no())?.to_path_buf(),
    };
    if dir_abs.join(&rel).is_file() {
        Ok(format!("/{}", rel.display()))
    } else {
        Err(no())
    }
}

fn check_dir(dir: &Path) -> Result<(), RootfsError> {
    let name = dir.display().to_string();
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(RootfsError::NotDir { dir: name }),
        Err(e) => Err(RootfsError::Read { dir: name, err: e.to_string() }),
    }
}

/// `path` made absolute, with `.` and `..` resolved lexically.
fn normal(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::from("/");
    for c in std::path::absolute(path).ok()?.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    Some(out)
}

/// Pack the tree at `dir` into an image whose program is `exec`.
pub fn pack(dir: &Path, exec: &str) -> Result<Vec<u8>, RootfsError> {
    let name = dir.display().to_string();
    let read = |err: std::io::Error, at: &Path| RootfsError::Read { dir: name.clone(), err: format!("{}: {err}", at.display()) };
    check_dir(dir)?;
    let mut items = BTreeMap::new();
    walk(dir, "", 0, &mut items).map_err(|(e, at)| read(e, &at))?;

    let strings_at = HEADER_SIZE + items.len() * ENTRY_SIZE;
    let mut strings = exec.as_bytes().to_vec();
    let mut table = Vec::with_capacity(items.len() * ENTRY_SIZE);
    let mut data: Vec<(u64, PathBuf)> = Vec::new();
    let strings_len: usize = exec.len() + items.keys().map(String::len).sum::<usize>();
    let mut data_at = (strings_at + strings_len).next_multiple_of(PAGE_SIZE as usize) as u64;
    for (path, item) in &items {
        let path_off = (strings_at + strings.len()) as u32;
        strings.extend_from_slice(path.as_bytes());
        let (kind, mode, off, size) = match item {
            Item::Dir(mode) => (KIND_DIR, *mode, 0, 0),
            Item::File(mode, host) => {
                let size = std::fs::metadata(host).map_err(|e| read(e, host))?.len();
                let off = data_at;
                data_at = (data_at + size).next_multiple_of(PAGE_SIZE);
                data.push((off, host.clone()));
                (KIND_FILE, *mode, off, size)
            }
        };
        for v in [path_off, path.len() as u32, kind, mode] {
            table.extend_from_slice(&v.to_le_bytes());
        }
        table.extend_from_slice(&off.to_le_bytes());
        table.extend_from_slice(&size.to_le_bytes());
    }
    if data_at > u32::MAX as u64 {
        return Err(RootfsError::TooLarge { dir: name, size: data_at >> 20 });
    }
    let mut out = Vec::with_capacity(data_at as usize);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(items.len() as u32).to_le_bytes());
    out.extend_from_slice(&((strings_at) as u32).to_le_bytes());
    out.extend_from_slice(&(exec.len() as u32).to_le_bytes());
    out.extend_from_slice(&data_at.to_le_bytes());
    out.extend_from_slice(&table);
    out.extend_from_slice(&strings);
    for (off, host) in data {
        out.resize(off as usize, 0);
        let bytes = std::fs::read(&host).map_err(|e| read(e, &host))?;
        out.extend_from_slice(&bytes);
    }
    out.resize(data_at as usize, 0);
    Ok(out)
}

/// Add what is in `dir` (the guest path `prefix`) to `items`.
fn walk(dir: &Path, prefix: &str, depth: usize, items: &mut BTreeMap<String, Item>) -> Result<(), (std::io::Error, PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    let entries = std::fs::read_dir(dir).map_err(|e| (e, dir.to_path_buf()))?;
    for entry in entries {
        let entry = entry.map_err(|e| (e, dir.to_path_buf()))?;
        let host = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_string) else { continue };
        // Follows symbolic links: the guest sees what they point at.
        let meta = std::fs::metadata(&host).map_err(|e| (e, host.clone()))?;
        let path = format!("{prefix}/{name}");
        let mode = meta.permissions().mode() & 0o7777;
        if meta.is_dir() {
            if depth >= MAX_DEPTH {
                return Err((std::io::Error::other("directories nested too deeply (a symbolic link loop?)"), host));
            }
            items.insert(path.clone(), Item::Dir(mode));
            walk(&host, &path, depth + 1, items)?;
        } else if meta.is_file() {
            items.insert(path, Item::File(mode, host));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftvm_abi::rootfs::{Archive, Kind};

    /// A scratch directory, removed when dropped.
    struct Tree(PathBuf);

    impl Tree {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tree() -> Tree {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let t = Tree(std::env::temp_dir().join(format!("ftvm-rootfs-test-{}-{n}", std::process::id())));
        std::fs::create_dir_all(t.path().join("usr/bin")).unwrap();
        std::fs::create_dir_all(t.path().join("lib")).unwrap();
        std::fs::write(t.path().join("usr/bin/prog"), b"\x7fELF program").unwrap();
        std::fs::write(t.path().join("lib/libc.so.6"), vec![7u8; 5000]).unwrap();
        std::os::unix::fs::symlink("libc.so.6", t.path().join("lib/libc.so")).unwrap();
        t
    }

    #[test]
    fn packs_directories_before_their_files_and_follows_links() {
        let t = tree();
        let bytes = pack(t.path(), "/usr/bin/prog").unwrap();
        let a = Archive::parse(&bytes).unwrap();
        assert_eq!(a.exec(), "/usr/bin/prog");
        let paths: Vec<&str> = a.entries().map(|e| e.path).collect();
        assert_eq!(paths, ["/lib", "/lib/libc.so", "/lib/libc.so.6", "/usr", "/usr/bin", "/usr/bin/prog"]);
        let libc = a.entries().find(|e| e.path == "/lib/libc.so.6").unwrap();
        assert_eq!((libc.kind, libc.data.len()), (Kind::File, 5000));
        assert!(libc.data.iter().all(|&b| b == 7));
        assert_eq!(a.entries().find(|e| e.path == "/lib/libc.so").unwrap().data, libc.data);
        assert_eq!(a.entries().find(|e| e.path == "/usr/bin/prog").unwrap().data, b"\x7fELF program");
        assert_eq!(a.entries().find(|e| e.path == "/usr").unwrap().kind, Kind::Dir);
        // File data is page-aligned in the image.
        assert!(a
            .entries()
            .filter(|e| e.kind == Kind::File)
            .all(|e| (e.data.as_ptr() as usize - bytes.as_ptr() as usize).is_multiple_of(4096)));
    }

    #[test]
    fn the_program_is_found_below_or_inside_the_tree() {
        let t = tree();
        assert_eq!(program_path(t.path(), &t.path().join("usr/bin/prog")).unwrap(), "/usr/bin/prog");
        assert_eq!(program_path(t.path(), Path::new("/usr/bin/prog")).unwrap(), "/usr/bin/prog");
        let e = program_path(t.path(), Path::new("/usr/bin/other")).unwrap_err().to_string();
        assert!(e.contains("is not in the root file system"), "{e}");
    }

    #[test]
    fn a_missing_or_plain_file_is_refused() {
        let t = tree();
        let e = pack(&t.path().join("nope"), "").unwrap_err().to_string();
        assert!(e.contains("No such file"), "{e}");
        let e = pack(&t.path().join("usr/bin/prog"), "").unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
    }

    #[test]
    fn a_damaged_image_is_refused_by_the_reader() {
        let t = tree();
        let mut bytes = pack(t.path(), "").unwrap();
        assert!(Archive::parse(&bytes[..16]).is_err());
        // The first entry's data offset far past the end.
        bytes[HEADER_SIZE + 16..HEADER_SIZE + 24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(Archive::parse(&bytes).unwrap_err(), ftvm_abi::rootfs::Error::Bounds);
    }
}
