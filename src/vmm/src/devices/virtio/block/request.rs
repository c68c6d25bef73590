//! A virtio-blk request as the device keeps it from the moment it pops the
//! chain until it places the used entry: what it asks for and where its
//! buffers are in guest memory. While in flight it is on the device's
//! pending list, which is saved with the device, so a VM restored from that
//! state can issue it again (the buffers are part of the saved memory: the
//! guest does not touch a buffer it has handed to the device).

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk as blk;
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend as _};

use crate::devices::virtio::VirtioError;
use crate::memory::GuestMemory;

/// The request header: type u32, reserved u32, sector u64.
const HEADER_LEN: u64 = 16;

/// One guest buffer (all or part of one descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub addr: u64,
    pub len: u32,
}

/// A request popped from the queue and not completed yet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingRequest {
    /// The chain's head descriptor, which its used entry names.
    pub head: u16,
    /// `VIRTIO_BLK_T_*`.
    pub kind: u32,
    pub sector: u64,
    /// The data buffers in chain order: what the device reads for a write,
    /// what it fills for a read; empty for a flush.
    pub data: Vec<Segment>,
    /// The status byte.
    pub status: u64,
}

fn chain_err(what: impl Into<String>) -> VirtioError {
    VirtioError::Chain(what.into())
}

/// `segs` cut after their first `n` bytes; None if they hold fewer.
fn split_front(segs: &[Segment], mut n: u64) -> Option<(Vec<Segment>, Vec<Segment>)> {
    let (mut front, mut back) = (Vec::new(), Vec::new());
    for &s in segs {
        let len = u64::from(s.len);
        if n >= len {
            front.push(s);
            n -= len;
        } else {
            if n > 0 {
                front.push(Segment { addr: s.addr, len: n as u32 });
            }
            back.push(Segment { addr: s.addr + n, len: (len - n) as u32 });
            n = 0;
        }
    }
    (n == 0).then_some((front, back))
}

fn total(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

impl PendingRequest {
    /// Read a request from its descriptor chain: device-readable buffers
    /// (the header, then a write's data) before device-writable ones (a
    /// read's data, then the status byte), each inside guest memory.
    pub fn parse(chain: DescriptorChain<&GuestMemory>, mem: &GuestMemory) -> Result<PendingRequest, VirtioError> {
        let head = chain.head_index();
        let (mut readable, mut writable) = (Vec::new(), Vec::new());
        for desc in chain {
            if !mem.check_range(desc.addr(), desc.len() as usize) {
                return Err(chain_err(format!("descriptor {:#x}+{} is outside guest memory", desc.addr().0, desc.len())));
            }
            let seg = Segment { addr: desc.addr().0, len: desc.len() };
            if desc.is_write_only() {
                writable.push(seg);
            } else if writable.is_empty() {
                readable.push(seg);
            } else {
                return Err(chain_err("a device-readable descriptor after a device-writable one"));
            }
        }
        let (header, out) = split_front(&readable, HEADER_LEN).ok_or_else(|| chain_err("block request without a whole header"))?;
        let room = total(&writable);
        if room == 0 {
            return Err(chain_err("block request without a status byte"));
        }
        let (into, status) = split_front(&writable, room - 1).expect("room - 1 bytes are there");
        let mut bytes = gather(&header, mem)?;
        bytes.resize(HEADER_LEN as usize, 0);
        let kind = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let data = match kind {
            blk::VIRTIO_BLK_T_OUT => out,
            blk::VIRTIO_BLK_T_IN | blk::VIRTIO_BLK_T_GET_ID => into,
            _ => Vec::new(),
        };
        Ok(PendingRequest { head, kind, sector, data, status: status[0].addr })
    }

    /// Bytes of data the request moves.
    pub fn data_len(&self) -> usize {
        total(&self.data) as usize
    }

    /// A write's data, from guest memory.
    pub fn gather(&self, mem: &GuestMemory) -> Result<Vec<u8>, VirtioError> {
        gather(&self.data, mem)
    }

    /// Fill the data buffers with `bytes` (at most their size); returns
    /// how many bytes went in.
    pub fn scatter(&self, mem: &GuestMemory, bytes: &[u8]) -> Result<usize, VirtioError> {
        let mut at = 0;
        for s in &self.data {
            if at == bytes.len() {
                break;
            }
            let n = (s.len as usize).min(bytes.len() - at);
            mem.write_slice(&bytes[at..at + n], GuestAddress(s.addr)).map_err(|e| chain_err(e.to_string()))?;
            at += n;
        }
        Ok(at)
    }

    pub fn set_status(&self, mem: &GuestMemory, status: u8) -> Result<(), VirtioError> {
        mem.write_slice(&[status], GuestAddress(self.status)).map_err(|e| chain_err(e.to_string()))
    }
}

fn gather(segs: &[Segment], mem: &GuestMemory) -> Result<Vec<u8>, VirtioError> {
    let mut bytes = vec![0u8; total(segs) as usize];
    let mut at = 0;
    for s in segs {
        let n = s.len as usize;
        mem.read_slice(&mut bytes[at..at + n], GuestAddress(s.addr)).map_err(|e| chain_err(e.to_string()))?;
        at += n;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(addr: u64, len: u32) -> Segment {
        Segment { addr, len }
    }

    #[test]
    fn split_front_cuts_inside_and_between_segments() {
        let segs = [seg(0x1000, 10), seg(0x2000, 20)];
        assert_eq!(split_front(&segs, 10), Some((vec![seg(0x1000, 10)], vec![seg(0x2000, 20)])));
        assert_eq!(split_front(&segs, 15), Some((vec![seg(0x1000, 10), seg(0x2000, 5)], vec![seg(0x2005, 15)])));
        assert_eq!(split_front(&segs, 4), Some((vec![seg(0x1000, 4)], vec![seg(0x1004, 6), seg(0x2000, 20)])));
        assert_eq!(split_front(&segs, 30), Some((segs.to_vec(), vec![])));
        assert_eq!(split_front(&segs, 31), None);
    }
}
