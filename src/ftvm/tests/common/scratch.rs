//! Scratch directories and small tmpfs mounts for tests that need files
//! (disk images) or a file system that fills up.

use std::fs::File;
use std::path::PathBuf;
use std::process::Command;

use super::stderr;

/// A scratch directory removed on Drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ftvm-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// A fresh sparse disk image of `size` bytes.
    pub fn disk(&self, name: &str, size: u64) -> PathBuf {
        let path = self.0.join(name);
        File::create(&path).unwrap().set_len(size).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small tmpfs mounted on a scratch directory, unmounted on Drop (after
/// the VMMs using it: declare it before them).
pub struct Tmpfs {
    pub dir: Scratch,
}

impl Tmpfs {
    pub fn mount(tag: &str, size: &str) -> Tmpfs {
        let dir = Scratch::new(tag);
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(&dir.0).output().unwrap();
        assert!(out.status.success(), "mount tmpfs: {}", stderr(&out));
        Tmpfs { dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Before `dir` is removed (fields drop after this).
        let ok = Command::new("umount").arg(&self.dir.0).status().is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.dir.0).status();
        }
    }
}
