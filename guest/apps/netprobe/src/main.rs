//! netprobe: bring-up and test program for the virtio devices. The command
//! line is a set of words (see `guest/README.md`): `ip=A.B.C.D/N [gw=..]
//! [echo]` brings the network up and serves (ICMP echo always, a TCP echo
//! server on port 7 with `echo`) forever; `blk=selftest|fill` exercises the
//! disk and exits (after `delay=MS` milliseconds, if given).
#![no_std]
#![no_main]

extern crate alloc;

use alloc::vec;
use alloc::vec::Vec;

use ftvm_rt::blk::{self, Disk, ID_LEN, SECTOR_SIZE};
use ftvm_rt::net::{ListenConfig, NetConfig, Stack};
use ftvm_rt::smoltcp::iface::SocketHandle;
use ftvm_rt::smoltcp::socket::tcp::{self, State};
use ftvm_rt::{println, Args};

ftvm_rt::entry!(main);

const ECHO_PORT: u16 = 7;
const SELFTEST_SECTORS: usize = 64;

fn main(args: &Args) -> i32 {
    let mut echo = false;
    let mut blk_action = None;
    let mut delay_ms = 0;
    for word in args.cmdline.split_ascii_whitespace() {
        match word.split_once('=') {
            None if word == "echo" => echo = true,
            Some(("blk", action)) => blk_action = Some(action),
            Some(("delay", ms)) if ms.parse::<u64>().is_ok() => delay_ms = ms.parse().unwrap_or(0),
            Some(("ip" | "gw", _)) => {}
            _ => {
                println!("netprobe: error: unknown word {word}");
                return 2;
            }
        }
    }
    if blk_action.is_some() {
        ftvm_rt::time::sleep_ns(delay_ms * 1_000_000);
    }
    match blk_action {
        Some("selftest") => return blk_selftest(),
        Some("fill") => return blk_fill(),
        Some(_) => {
            println!("netprobe: error: blk= takes selftest or fill");
            return 2;
        }
        None => {}
    }
    let config = match NetConfig::from_cmdline(args.cmdline) {
        Ok(c) => c,
        Err(e) => {
            println!("netprobe: error: {e}");
            return 2;
        }
    };
    let mut stack = match Stack::new(config) {
        Ok(s) => s,
        Err(e) => {
            println!("netprobe: error: {e}");
            return 1;
        }
    };
    if echo {
        let mut listen = ListenConfig::new(ECHO_PORT);
        listen.rx_buffer = 16 * 1024;
        listen.tx_buffer = 16 * 1024;
        if let Err(e) = stack.listen(listen) {
            println!("netprobe: error: {e}");
            return 1;
        }
    }
    let m = stack.mac().0;
    println!("netprobe: up ip={} mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", config.ip, m[0], m[1], m[2], m[3], m[4], m[5]);
    let mut conns: Vec<SocketHandle> = Vec::new();
    loop {
        let mut progress = stack.poll();
        if echo {
            while let Some(h) = stack.accept(ECHO_PORT) {
                conns.push(h);
                progress = true;
            }
            progress |= serve_echo(&mut stack, &mut conns);
        }
        if !progress {
            stack.wait_idle();
        }
    }
}

/// Copy what each connection received back to it; close connections whose
/// peer has finished once everything is echoed. Returns whether any byte
/// moved or any connection ended.
fn serve_echo(stack: &mut Stack, conns: &mut Vec<SocketHandle>) -> bool {
    let mut progress = false;
    let mut scratch = [0u8; 4096];
    let mut i = 0;
    while i < conns.len() {
        let h = conns[i];
        let s = stack.sockets_mut().get_mut::<tcp::Socket>(h);
        while s.can_recv() && s.can_send() {
            let room = (s.send_capacity() - s.send_queue()).min(scratch.len());
            let n = s.recv_slice(&mut scratch[..room]).unwrap_or(0);
            if n == 0 {
                break;
            }
            // Never short: `room` bytes of the send buffer are free.
            let _ = s.send_slice(&scratch[..n]);
            progress = true;
        }
        if !s.may_recv() && !s.can_recv() && s.send_queue() == 0 && s.state() == State::CloseWait {
            s.close();
            progress = true;
        }
        if matches!(s.state(), State::Closed | State::TimeWait) {
            stack.release(h);
            conns.swap_remove(i);
            progress = true;
        } else {
            i += 1;
        }
    }
    progress
}

fn open_disk() -> Option<Disk> {
    match Disk::open() {
        Ok(d) => Some(d),
        Err(e) => {
            println!("netprobe: blk error: {e}");
            None
        }
    }
}

fn pattern(sector: usize, i: usize, salt: u8) -> u8 {
    (sector.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8 ^ salt
}

/// Write a pattern to sectors 0..64, overwrite one sector alone, read
/// everything back, flush, and check that an out-of-range read fails.
fn blk_selftest() -> i32 {
    let Some(mut disk) = open_disk() else {
        return 1;
    };
    match selftest(&mut disk) {
        Ok(id) => {
            let id: Vec<u8> = id.iter().take_while(|&&b| b != 0).map(|&b| if b.is_ascii_graphic() { b } else { b'?' }).collect();
            println!("netprobe: blk ok capacity={} id={}", disk.capacity_sectors(), core::str::from_utf8(&id).unwrap_or("?"));
            0
        }
        Err(e) => {
            println!("netprobe: blk error: {e}");
            1
        }
    }
}

fn selftest(disk: &mut Disk) -> Result<[u8; ID_LEN], blk::Error> {
    let n = SELFTEST_SECTORS;
    if disk.capacity_sectors() < n as u64 {
        return Err(blk::Error::OutOfRange { sector: 0, sectors: n as u64 });
    }
    let mut data = vec![0u8; n * SECTOR_SIZE];
    for (i, b) in data.iter_mut().enumerate() {
        *b = pattern(i / SECTOR_SIZE, i % SECTOR_SIZE, 0x5a);
    }
    disk.write(0, &data)?;
    // A single-sector write in the middle must replace exactly that sector.
    let odd = 7;
    let one: Vec<u8> = (0..SECTOR_SIZE).map(|i| pattern(odd, i, 0xa5)).collect();
    disk.write(odd as u64, &one)?;
    data[odd * SECTOR_SIZE..(odd + 1) * SECTOR_SIZE].copy_from_slice(&one);
    let mut back = vec![0u8; n * SECTOR_SIZE];
    disk.read(0, &mut back)?;
    if back != data {
        let at = back.iter().zip(&data).position(|(a, b)| a != b).unwrap_or(0);
        println!("netprobe: blk error: readback differs at byte {at}");
        return Err(blk::Error::Io);
    }
    disk.flush()?;
    let end = disk.capacity_sectors();
    if disk.read(end, &mut back[..SECTOR_SIZE]).is_ok() {
        println!("netprobe: blk error: read past the end succeeded");
        return Err(blk::Error::Io);
    }
    disk.id()
}

/// Write 64 KiB chunks from sector 0 until the disk ends or a write fails
/// (a full host disk answers IOERR), then report how far it got. Every
/// sector is stamped with its number: its first 8 bytes are the number
/// (little-endian), the others its low byte xor 0xa5, so a write that lands
/// in the wrong place shows.
fn blk_fill() -> i32 {
    let Some(mut disk) = open_disk() else {
        return 1;
    };
    let mut chunk = vec![0u8; 64 * 1024];
    let per = (chunk.len() / SECTOR_SIZE) as u64;
    let cap = disk.capacity_sectors();
    let mut at = 0u64;
    let mut result = Ok(());
    while at < cap && result.is_ok() {
        let n = per.min(cap - at);
        for (i, sector) in chunk.chunks_exact_mut(SECTOR_SIZE).enumerate() {
            let number = at + i as u64;
            sector[..8].copy_from_slice(&number.to_le_bytes());
            sector[8..].fill(number as u8 ^ 0xa5);
        }
        result = disk.write(at, &chunk[..n as usize * SECTOR_SIZE]);
        if result.is_ok() {
            at += n;
        }
    }
    let result = result.and_then(|()| disk.flush());
    match result {
        Ok(()) => {
            println!("netprobe: blk fill wrote={at} result=ok");
            0
        }
        Err(e) => {
            println!("netprobe: blk fill wrote={at} result=error: {e}");
            1
        }
    }
}
