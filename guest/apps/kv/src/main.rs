//! kv: a Redis-protocol (RESP2) server, `ftvm-kv` on the guest runtime's
//! TCP/IP stack, with an optional append-only log on the VM's disk.
//!
//! Command line: `ip=A.B.C.D/N [gw=A.B.C.D] [port=6379] [aof=on|off]
//! [maxconn=256] [epoch_ms=MS]` (see `guest/README.md`).
#![no_std]
#![no_main]

extern crate alloc;

mod aof;
mod conn;

use alloc::boxed::Box;
use alloc::vec::Vec;

use ftvm_kv::Server;
use ftvm_rt::blk::Disk;
use ftvm_rt::net::{ListenConfig, NetConfig, Stack};
use ftvm_rt::smoltcp::socket::tcp::Socket;
use ftvm_rt::smoltcp::time::Duration;
use ftvm_rt::time::{self, NS_PER_MS};
use ftvm_rt::{println, Args};

use aof::{DiskLog, Log};
use conn::{Client, Ctx};

ftvm_rt::entry!(main);

/// Connections listening at once: a burst of this many connects is
/// accepted before the stack replaces the listening sockets it took.
const BACKLOG: usize = 16;
/// Socket buffers: enough for `redis-benchmark -P 16` bursts each way.
const SOCKET_BUFFER: usize = 64 * 1024;
/// A peer that stops acknowledging for this long is dropped, so dead
/// clients do not hold connection slots for ever.
const PEER_TIMEOUT_S: u64 = 60;
/// Idle loops give back memory of expired keys at most this often.
const EXPIRE_EVERY_MS: u64 = 1000;

struct Options {
    port: u16,
    aof: bool,
    maxconn: usize,
    /// Added to guest time to make the server's clock: expiry times in
    /// the log are absolute, and guest time restarts at 0 on every boot.
    epoch_ms: u64,
    /// Notify the network device by the exact event-index rule.
    exact_notify: bool,
}

fn parse(cmdline: &str) -> Result<Options, &'static str> {
    let mut o = Options { port: 6379, aof: false, maxconn: 256, epoch_ms: 0, exact_notify: true };
    for word in cmdline.split_ascii_whitespace() {
        let (key, value) = word.split_once('=').ok_or("expected KEY=VALUE words")?;
        match key {
            "ip" | "gw" => {}
            "port" => o.port = value.parse().ok().filter(|&p| p != 0).ok_or("bad port=")?,
            "aof" => {
                o.aof = match value {
                    "on" => true,
                    "off" => false,
                    _ => return Err("aof= takes on or off"),
                }
            }
            "maxconn" => o.maxconn = value.parse().ok().filter(|&n| n != 0).ok_or("bad maxconn=")?,
            "epoch_ms" => o.epoch_ms = value.parse().map_err(|_| "bad epoch_ms=")?,
            "notify" => {
                o.exact_notify = match value {
                    "exact" => true,
                    "eager" => false,
                    _ => return Err("notify= takes exact or eager"),
                }
            }
            _ => return Err("unknown word (expected ip, gw, port, aof, maxconn, epoch_ms, notify)"),
        }
    }
    Ok(o)
}

fn main(args: &Args) -> i32 {
    let (opts, net) = match parse(args.cmdline).map_err(net_error).and_then(|o| {
        let net = NetConfig::from_cmdline(args.cmdline)?;
        Ok((o, net))
    }) {
        Ok(x) => x,
        Err(e) => {
            println!("kv: error: {e}");
            return 2;
        }
    };
    let now_ms = || opts.epoch_ms.saturating_add(time::now_ns() / NS_PER_MS);
    // TIME reports this clock in microseconds: guest time since boot (plus
    // the epoch_ms= offset), read once per pass over the connections.
    let now_us = || opts.epoch_ms.saturating_mul(1000).saturating_add(time::now_ns() / 1000);
    let mut server = Server::new();
    server.set_free_memory(ftvm_rt::heap::free_bytes);
    let mut log = Log::Off;
    if opts.aof {
        let disk = match Disk::open() {
            Ok(d) => d,
            Err(e) => {
                println!("kv: error: {e}");
                return 1;
            }
        };
        let (disk_log, replayed) = match DiskLog::open(disk, &mut server, now_ms()) {
            Ok(x) => x,
            Err(e) => {
                println!("kv: error: reading the log: {e}");
                return 1;
            }
        };
        println!("kv: replayed {} records, {} keys", replayed.records, server.dbsize());
        if replayed.rejected > 0 {
            println!("kv: warning: {} log records rejected", replayed.rejected);
        }
        server.set_appendonly(true);
        log = Log::Disk(Box::new(disk_log));
    }
    ftvm_rt::net::set_exact_notify(opts.exact_notify);
    let mut stack = match Stack::new(net) {
        Ok(s) => s,
        Err(e) => {
            println!("kv: error: {e}");
            return 1;
        }
    };
    let mut listen = ListenConfig::new(opts.port);
    listen.backlog = BACKLOG;
    listen.max_conns = opts.maxconn;
    listen.rx_buffer = SOCKET_BUFFER;
    listen.tx_buffer = SOCKET_BUFFER;
    if let Err(e) = stack.listen(listen) {
        println!("kv: error: {e}");
        return 1;
    }
    println!("kv: listening on {}:{} aof={}", net.ip.address(), opts.port, if opts.aof { "on" } else { "off" });

    let mut clients: Vec<Client> = Vec::new();
    let mut last_expire = 0;
    loop {
        let mut progress = stack.poll();
        while let Some(h) = stack.accept(opts.port) {
            let s = stack.sockets_mut().get_mut::<Socket>(h);
            s.set_timeout(Some(Duration::from_secs(PEER_TIMEOUT_S)));
            clients.push(Client::new(h));
            progress = true;
        }
        let now_us = now_us();
        let now = now_us / 1000;
        let mut cx = Ctx { server: &mut server, log: &mut log, now_us };
        let mut i = 0;
        while i < clients.len() {
            let s = stack.sockets_mut().get_mut::<Socket>(clients[i].handle);
            let (moved, finished) = clients[i].service(s, &mut cx);
            progress |= moved;
            if finished {
                stack.release(clients[i].handle);
                clients.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if !progress {
            if now >= last_expire + EXPIRE_EVERY_MS {
                server.expire(now);
                last_expire = now;
            }
            stack.wait_idle();
        }
    }
}

fn net_error(e: &'static str) -> ftvm_rt::net::Error {
    ftvm_rt::net::Error::Config(e)
}
