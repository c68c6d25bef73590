//! A directory of one's own under the system temp directory, removed on
//! drop.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// When the directory is removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Keep {
    Never,
    /// Kept when dropped during a panic (a failing test), for a post mortem.
    OnPanic,
}

/// A fresh, empty directory `TMP/ftvm-TAG-PID-N`, removed with its
/// contents on drop.
pub struct Scratch {
    path: PathBuf,
    keep: Keep,
}

/// The directory name for `tag`: `ftvm-TAG-PID-N`, where N counts the
/// directories this process made, so names never repeat within a process
/// and the pid keeps processes apart. `tag` is reduced to characters that
/// are safe in a file name.
pub fn dir_name(tag: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let safe = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    let tag = crate::name_prefix(tag, 32, safe, "scratch");
    format!("ftvm-{tag}-{}-{n}", std::process::id())
}

impl Scratch {
    /// Create the directory (a leftover of that name, from a killed run of a
    /// process with the same pid, is removed first).
    pub fn new(tag: &str) -> io::Result<Scratch> {
        let path = std::env::temp_dir().join(dir_name(tag));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)?;
        Ok(Scratch { path, keep: Keep::Never })
    }

    /// Keep the files if the owner is dropped by a panic (a failing test),
    /// and say where they are on stderr.
    pub fn keep_on_panic(mut self) -> Scratch {
        self.keep = Keep::OnPanic;
        self
    }

    /// Never remove the directory; returns its path.
    pub fn keep(self) -> PathBuf {
        let path = self.path.clone();
        std::mem::forget(self);
        path
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` inside the directory.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }

    /// A new sparse file `name` of `size` bytes (e.g. a disk image).
    pub fn sparse_file(&self, name: &str, size: u64) -> io::Result<PathBuf> {
        let path = self.join(name);
        File::create(&path)?.set_len(size)?;
        Ok(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.keep == Keep::OnPanic && std::thread::panicking() {
            // Not eprintln!: a closed stderr must not panic again while unwinding.
            let _ = writeln!(io::stderr(), "files of the failed test kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_file_name_safe() {
        let (a, b) = (dir_name("net/full disk"), dir_name("net/full disk"));
        assert_ne!(a, b);
        let pid = std::process::id().to_string();
        assert!(a.starts_with("ftvm-netfulldisk-") && a.contains(&pid), "{a}");
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'), "{a}");
        assert!(dir_name("").starts_with("ftvm-scratch-"));
    }

    #[test]
    fn created_empty_and_removed_on_drop() {
        let s = Scratch::new("kit").unwrap();
        let dir = s.path().to_owned();
        assert!(dir.starts_with(std::env::temp_dir()) && dir.is_dir());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let disk = s.sparse_file("disk.img", 1 << 20).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 1 << 20);
        drop(s);
        assert!(!dir.exists());
    }

    #[test]
    fn kept_when_asked_or_on_panic() {
        let kept = Scratch::new("kit").unwrap().keep();
        assert!(kept.is_dir());
        std::fs::remove_dir_all(&kept).unwrap();

        let (tx, rx) = std::sync::mpsc::channel();
        let panicked = std::thread::spawn(move || {
            let s = Scratch::new("kit").unwrap().keep_on_panic();
            tx.send(s.path().to_owned()).unwrap();
            panic!("a failing test");
        })
        .join();
        assert!(panicked.is_err());
        let dir = rx.recv().unwrap();
        assert!(dir.is_dir(), "a failed test's files are kept");
        std::fs::remove_dir_all(&dir).unwrap();

        let s = Scratch::new("kit").unwrap().keep_on_panic();
        let dir = s.path().to_owned();
        drop(s);
        assert!(!dir.exists(), "removed when nothing failed");
    }
}
