//! A small tmpfs on a scratch directory: a host disk that fills up.
//! Mounting needs root.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::scratch::Scratch;

/// A tmpfs of a given size mounted on a [`Scratch`] directory; unmounted,
/// then removed, on drop. Drop it after the processes writing to it.
pub struct Tmpfs {
    dir: Scratch,
}

impl Tmpfs {
    /// Mount a tmpfs of `size` (as `mount -o size=`: `2M`, `512k`).
    pub fn mount(tag: &str, size: &str) -> io::Result<Tmpfs> {
        let dir = Scratch::new(tag)?;
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir.path()).output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "mount tmpfs on {}: {}",
                dir.path().display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(Tmpfs { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A new sparse file `name` of `size` bytes on the tmpfs.
    pub fn sparse_file(&self, name: &str, size: u64) -> io::Result<PathBuf> {
        self.dir.sparse_file(name, size)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Before `dir` is removed (fields drop after this).
        let ok = Command::new("umount").arg(self.dir.path()).status().is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
        }
    }
}

/// The file system holding a path, as `stat` and `statvfs` see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileSystem {
    /// Its device number (`st_dev`): equal for two paths on the same one.
    pub dev: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Its unit of allocation in bytes (a page on tmpfs).
    pub unit: u64,
}

/// The file system `path` is on. Through `/proc/PID/root/...` this is the
/// file system another process (in another mount namespace) sees there.
pub fn file_system(path: &Path) -> io::Result<FileSystem> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: statvfs is plain old data, for which all zeroes is a value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is a valid, writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let dev = std::fs::metadata(path)?.dev();
    Ok(FileSystem { dev, size: st.f_blocks * st.f_frsize, unit: st.f_frsize })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mounted_tmpfs_has_its_size_and_goes_away() {
        let fs = Tmpfs::mount("tmpfs-test", "1M").unwrap();
        let dir = fs.path().to_owned();
        let info = file_system(&dir).unwrap();
        assert_eq!(info.size, 1 << 20);
        assert_ne!(info.dev, file_system(&std::env::temp_dir()).unwrap().dev);
        let file = fs.sparse_file("f", 8 << 20).unwrap();
        assert_eq!(file_system(&file).unwrap(), info);
        // More than 1 MiB of data does not fit.
        let err = std::fs::write(fs.path().join("big"), vec![1u8; 2 << 20]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        drop(fs);
        assert!(!dir.exists());
    }
}
