//! The shared secret of an authenticated replication channel
//! (`--secret-file`): read from a file only its owner can read, and kept
//! only as a key derived from it.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Key derivation context of the long-term key (BLAKE3 `derive_key`).
const CONTEXT: &str = "ftvm replication 2025 secret file to long-term key";
/// A secret file larger than this is most likely the wrong file.
const MAX_LEN: u64 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read secret file {path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("secret file {path} is not a regular file")]
    NotAFile { path: PathBuf },
    #[error("secret file {path} is empty")]
    Empty { path: PathBuf },
    #[error("secret file {path} is larger than {MAX_LEN} bytes")]
    TooLarge { path: PathBuf },
    #[error("secret file {path} is accessible by group or others (mode {mode:03o}); make it private with chmod 600")]
    Permissions { path: PathBuf, mode: u32 },
}

/// The long-term key both ends derive from the secret file's bytes (all of
/// them, a trailing newline included).
#[derive(Clone)]
pub struct Secret {
    key: [u8; 32],
}

impl Secret {
    /// Read the secret from `path`: a regular, non-empty file that neither
    /// group nor others may read or write.
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let read = |err| SecretError::Read { path: path.into(), err };
        // Non-blocking: opening a FIFO would wait for a writer (the check
        // below refuses it); reads of a regular file are not affected.
        let mut file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(read)?;
        // The checks look at the file that was opened, not at the path again.
        let meta = file.metadata().map_err(read)?;
        if !meta.is_file() {
            return Err(SecretError::NotAFile { path: path.into() });
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Permissions { path: path.into(), mode });
        }
        if meta.size() > MAX_LEN {
            return Err(SecretError::TooLarge { path: path.into() });
        }
        let mut bytes = Vec::new();
        file.by_ref().take(MAX_LEN + 1).read_to_end(&mut bytes).map_err(read)?;
        if bytes.is_empty() {
            return Err(SecretError::Empty { path: path.into() });
        }
        if bytes.len() < 16 {
            tracing::warn!(path = %path.display(), len = bytes.len(), "short replication secret; use at least 32 random bytes");
        }
        let secret = Secret::from_bytes(&bytes);
        bytes.fill(0);
        Ok(secret)
    }

    /// The key for secret `bytes` (non-empty).
    pub fn from_bytes(bytes: &[u8]) -> Secret {
        Secret { key: blake3::derive_key(CONTEXT, bytes) }
    }

    pub(super) fn key(&self) -> &[u8; 32] {
        &self.key
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.key.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, bytes: &[u8], mode: u32) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ftvm-secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn private_files_give_the_same_key_as_their_bytes() {
        let path = file("good", b"correct horse battery staple\n", 0o600);
        let s = Secret::from_file(&path).unwrap();
        assert_eq!(s.key(), Secret::from_bytes(b"correct horse battery staple\n").key());
        assert_ne!(s.key(), Secret::from_bytes(b"correct horse battery staple").key());
        assert_eq!(format!("{s:?}"), "Secret(..)");
        assert!(Secret::from_file(&file("readonly", b"x", 0o400)).is_ok());
    }

    #[test]
    fn bad_files_are_refused() {
        let r = Secret::from_file(&file("shared", b"secret", 0o640));
        assert!(matches!(r, Err(SecretError::Permissions { mode: 0o640, .. })), "{r:?}");
        assert!(r.unwrap_err().to_string().contains("accessible by group or others (mode 640)"));
        assert!(matches!(Secret::from_file(&file("world", b"secret", 0o604)), Err(SecretError::Permissions { .. })));
        assert!(matches!(Secret::from_file(&file("empty", b"", 0o600)), Err(SecretError::Empty { .. })));
        let missing = std::env::temp_dir().join("ftvm-secret-test-does-not-exist");
        assert!(matches!(Secret::from_file(&missing), Err(SecretError::Read { .. })));
        assert!(matches!(Secret::from_file(Path::new("/")), Err(SecretError::NotAFile { .. } | SecretError::Permissions { .. })));
        assert!(matches!(Secret::from_file(&file("big", &vec![1u8; MAX_LEN as usize + 1], 0o600)), Err(SecretError::TooLarge { .. })));
        // A FIFO with no writer: refused, not waited on.
        let fifo = std::env::temp_dir().join(format!("ftvm-secret-test-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&fifo);
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path; mkfifo only creates the file.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        assert!(matches!(Secret::from_file(&fifo), Err(SecretError::NotAFile { .. })));
        std::fs::remove_file(&fifo).unwrap();
    }
}
