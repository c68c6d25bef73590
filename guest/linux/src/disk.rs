//! The persistent directory: the virtio-blk disk holds an ftvm-fs file
//! system (`ftvm-diskfs`, format in `docs/guest-abi.md`), mounted where
//! `disk=PATH` says. Its writes reach the VMM's disk, so they survive a
//! restart on the same disk file and, under replication, travel with the
//! checkpoints (the disk journal).

use ftvm_diskfs::{BlockDevice, DiskFs, Error, IoError, BLOCK};
use ftvm_rt::blk::{self, Disk, SECTOR_SIZE};

use crate::errno::*;

const SECTORS_PER_BLOCK: u64 = (BLOCK / SECTOR_SIZE) as u64;

/// The first virtio-blk device, in file-system blocks.
pub struct Blk(Disk);

impl BlockDevice for Blk {
    fn blocks(&self) -> u64 {
        self.0.capacity_sectors() / SECTORS_PER_BLOCK
    }

    // The device reads and writes guest-physical memory, and `buf` may be
    // a forked process's (elsewhere in RAM than its address says): the data
    // goes through runtime memory, identity-mapped in every process.
    fn read(&mut self, block: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let mut bounce = alloc::vec![0u8; buf.len()];
        self.0.read(block * SECTORS_PER_BLOCK, &mut bounce).map_err(report)?;
        buf.copy_from_slice(&bounce);
        Ok(())
    }

    fn write(&mut self, block: u64, buf: &[u8]) -> Result<(), IoError> {
        let bounce = buf.to_vec();
        self.0.write(block * SECTORS_PER_BLOCK, &bounce).map_err(report)
    }

    fn flush(&mut self) -> Result<(), IoError> {
        self.0.flush().map_err(report)
    }
}

/// A failed disk request is EIO to the program; the console says why.
fn report(e: blk::Error) -> IoError {
    ftvm_rt::println!("linux: disk error: {e}");
    IoError
}

pub type Fs = DiskFs<Blk>;

/// Open the disk and mount its file system, formatting a blank disk.
pub fn mount(path: &str) -> Result<Fs, alloc::string::String> {
    use alloc::format;
    let disk = Disk::open().map_err(|e| format!("disk={path}: {e} (give the VM a disk: ftvm run --disk FILE)"))?;
    let (fs, formatted) = DiskFs::mount_or_format(Blk(disk), crate::sys::time::realtime_ns()).map_err(|e| format!("disk={path}: {e}"))?;
    ftvm_rt::println!(
        "linux: disk mounted at {path} ({} MiB free{})",
        (fs.free_blocks() * BLOCK as u64) >> 20,
        if formatted { ", formatted now: it was blank" } else { "" }
    );
    Ok(fs)
}

pub fn errno(e: Error) -> Errno {
    match e {
        Error::NoSpace => ENOSPC,
        Error::NotFound => ENOENT,
        Error::Exists => EEXIST,
        Error::NotDir => ENOTDIR,
        Error::IsDir => EISDIR,
        Error::NotEmpty => ENOTEMPTY,
        Error::NameTooLong => ENAMETOOLONG,
        Error::Invalid => EINVAL,
        Error::Io | Error::TooSmall | Error::Foreign | Error::Corrupt(_) => EIO,
    }
}
