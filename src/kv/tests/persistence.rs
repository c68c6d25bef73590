//! Log records, failed appends, replay, and the on-device framing.

mod common;
use common::{resp, show, MemLog, H};
use ftvm_kv::{aof, LogError, LogSink, NoLog, ReplayError, Server};

/// Every key with its value and remaining TTL, as a client sees them.
fn dump(srv: &mut Server, now: u64) -> Vec<String> {
    let mut conn = ftvm_kv::Connection::new();
    let mut out = Vec::new();
    srv.handle(&mut conn, &resp(&[b"KEYS", b"*"]), now, &mut NoLog, &mut out);
    let text = String::from_utf8(out).unwrap();
    let mut keys: Vec<&str> = text.split("\r\n").filter(|l| !l.is_empty() && !l.starts_with(['*', '$'])).collect();
    keys.sort();
    keys.iter()
        .map(|k| {
            let mut out = Vec::new();
            srv.handle(&mut conn, &resp(&[b"GET", k.as_bytes()]), now, &mut NoLog, &mut out);
            srv.handle(&mut conn, &resp(&[b"PTTL", k.as_bytes()]), now, &mut NoLog, &mut out);
            format!("{k} {}", String::from_utf8_lossy(&out).replace("\r\n", " "))
        })
        .collect()
}

#[test]
fn only_mutations_are_logged_in_normal_form() {
    let mut h = H::new();
    let now = h.now;
    for c in [
        "PING",
        "GET a",
        "SET a 1",
        "SET a 2 NX",
        "SET b 2 XX",
        "SET b 2 EX 10",
        "SET c 3 PX 5 GET",
        "SET b 3 KEEPTTL",
        "INCR a",
        "DECRBY b 5",
        "EXISTS a",
        "DEL nope",
        "DEL a nope b a",
        "APPEND s x",
        "APPEND s y",
        "MSET m 1 n 2",
        "MGET m n",
        "DBSIZE",
        "INFO",
        "KEYS *",
        "TTL b",
        "STRLEN s",
        "FLUSHDB",
        "FLUSHALL",
        "INCR a",
        "CONFIG GET save",
    ] {
        h.cmd(c);
    }
    let records: Vec<String> = h.log.records.iter().map(|r| show(r)).collect();
    let at10 = now + 10_000;
    assert_eq!(
        records,
        [
            "SET a 1".to_string(),
            format!("SET b 2 PXAT {at10}"),
            format!("SET c 3 PXAT {}", now + 5),
            format!("SET b 3 PXAT {at10}"),
            "SET a 2".into(),
            format!("SET b -2 PXAT {at10}"),
            "DEL a b a".into(),
            "SET s x".into(),
            "APPEND s y".into(),
            "MSET m 1 n 2".into(),
            "FLUSHALL".into(),
            "FLUSHALL".into(),
            "SET a 1".into(),
        ]
    );
}

#[test]
fn failed_append_leaves_store_unchanged() {
    for err in [LogError::Full, LogError::Io] {
        let mut h = H::new();
        h.cmd("SET a 1");
        h.cmd("SET t x EX 100");
        let before = dump(&mut h.srv, h.now);
        h.log.fail = Some(err);
        let msg = format!("-ERR {err}: append-only log write failed, command not applied\r\n");
        for c in [
            "SET a 2",
            "SET b 2 NX",
            "SET a 2 GET",
            "INCR a",
            "DECR a",
            "INCRBY n 5",
            "APPEND a x",
            "APPEND z x",
            "MSET a 9 z 9",
            "DEL a",
            "DEL a t",
            "FLUSHALL",
            "FLUSHDB",
            "SET t y KEEPTTL",
        ] {
            assert_eq!(h.cmd(c), msg, "{c}");
        }
        assert_eq!(dump(&mut h.srv, h.now), before);
        // Reads and no-op writes still work, logging nothing.
        assert_eq!(h.cmd("GET a"), "$1\r\n1\r\n");
        assert_eq!(h.cmd("SET a 5 NX"), "$-1\r\n");
        assert_eq!(h.cmd("DEL nope"), ":0\r\n");
        h.log.fail = None;
        assert_eq!(h.cmd("INCR a"), ":2\r\n");
    }
    assert_eq!(LogError::Full.to_string(), "disk full");
    assert_eq!(LogError::Io.to_string(), "I/O error");
}

#[test]
fn nolog_accepts_everything() {
    let mut srv = Server::new();
    let mut conn = ftvm_kv::Connection::new();
    let mut out = Vec::new();
    srv.handle(&mut conn, &resp(&[b"SET", b"a", b"1"]), 0, &mut NoLog, &mut out);
    assert_eq!(out, b"+OK\r\n");
    assert_eq!(NoLog.append(b"x"), Ok(()));
}

/// Run a workload with a log, replay the log into a fresh server later, and
/// compare what clients would see.
#[test]
fn replay_reproduces_state() {
    let mut h = H::new();
    let t0 = h.now;
    let script = [
        "SET plain v",
        "SET ex v EX 100",
        "SET px v PX 500",
        "SET short v PX 50",
        "SET gone v",
        "DEL gone",
        "INCR n",
        "INCRBY n 41",
        "SET ttln 7 EX 1000",
        "INCR ttln",
        "APPEND s abc",
        "APPEND s def",
        "SET ttls x PX 2000",
        "APPEND ttls y",
        "MSET m1 a m2 b plain w",
        "FLUSHALL",
        "SET after flush",
        "MSET x 1 y 2 z 3",
        "DEL y",
        "SET keep a EX 50",
        "SET keep b KEEPTTL",
        "SET nx 1 NX",
        "SET nx 2 NX",
        "SET xx 1 XX",
        "DECR x",
        "APPEND z 4",
        "SET fleeting v PX 20",
    ];
    for (i, c) in script.iter().enumerate() {
        h.now = t0 + i as u64;
        assert!(!h.cmd(c).starts_with('-'), "{c}");
    }
    // A key expires before it is touched again: the second APPEND sees an
    // empty key, and logs a SET rather than an APPEND.
    h.cmd("SET e1 old PX 5");
    h.now += 10;
    h.cmd("APPEND e1 new");
    h.cmd("SET e2 5 PX 5");
    h.now += 10;
    h.cmd("INCR e2");
    let size_now = h.srv.dbsize();

    for later in [h.now, h.now + 15, h.now + 600, h.now + 100_000, h.now + 10_000_000] {
        let mut fresh = Server::new();
        for r in &h.log.records {
            fresh.replay(r, later).unwrap();
        }
        assert_eq!(dump(&mut fresh, later), dump(&mut h.srv, later), "replayed at +{}", later - t0);
    }
    let mut fresh = Server::new();
    for r in &h.log.records {
        fresh.replay(r, h.now).unwrap();
    }
    assert_eq!(fresh.dbsize(), size_now);
}

#[test]
fn replay_of_append_to_key_expired_by_then() {
    // At run time the key was live, so APPEND is logged as APPEND; at replay
    // time it has expired and must stay gone, not come back without a TTL.
    let mut h = H::new();
    h.cmd("SET k a PX 100");
    h.cmd("APPEND k b");
    let mut fresh = Server::new();
    for r in &h.log.records {
        fresh.replay(r, h.now + 1000).unwrap();
    }
    assert_eq!(fresh.dbsize(), 0);
    assert!(dump(&mut fresh, h.now + 1000).is_empty());
}

#[test]
fn replay_rejects_bad_records_without_change() {
    let mut srv = Server::new();
    srv.replay(&resp(&[b"SET", b"a", b"1"]), 0).unwrap();
    for (rec, err) in [
        (b"".to_vec(), ReplayError::Malformed),
        (b"SET a 2\r\n".to_vec(), ReplayError::Malformed),
        (b"*3\r\n$3\r\nSET\r\n$1\r\na\r\n".to_vec(), ReplayError::Malformed),
        ([resp(&[b"SET", b"a", b"2"]), b"x".to_vec()].concat(), ReplayError::Malformed),
        (resp(&[b"GET", b"a"]), ReplayError::UnknownCommand),
        (resp(&[b"INCR", b"a"]), ReplayError::UnknownCommand),
        (resp(&[b"SET", b"a", b"2", b"EX", b"5"]), ReplayError::BadArguments),
        (resp(&[b"SET", b"a", b"2", b"PXAT", b"x"]), ReplayError::BadArguments),
        (resp(&[b"SET", b"a"]), ReplayError::BadArguments),
        (resp(&[b"MSET", b"a"]), ReplayError::BadArguments),
        (resp(&[b"DEL"]), ReplayError::BadArguments),
        (resp(&[b"FLUSHALL", b"x"]), ReplayError::BadArguments),
        (resp(&[b"APPEND", b"a"]), ReplayError::BadArguments),
    ] {
        assert_eq!(srv.replay(&rec, 0), Err(err), "{:?}", String::from_utf8_lossy(&rec));
    }
    assert_eq!(dump(&mut srv, 0), ["a $1 1 :-1 "]);
    // Replay can go on after a rejected record.
    srv.replay(&resp(&[b"append", b"a", b"2"]), 0).unwrap();
    assert_eq!(dump(&mut srv, 0), ["a $2 12 :-1 "]);
}

#[test]
fn aof_roundtrip_and_torn_tails() {
    let payloads: Vec<Vec<u8>> = (0..50).map(|i| resp(&[b"SET", format!("k{i}").as_bytes(), &vec![b'v'; i * 7 + 1]])).collect();
    let mut dev = Vec::new();
    let mut ends = Vec::new();
    for p in &payloads {
        aof::encode(p, &mut dev);
        ends.push(dev.len());
    }
    let got: Vec<(&[u8], usize)> = aof::records(&dev).collect();
    assert_eq!(got.len(), 50);
    for (i, (p, end)) in got.iter().enumerate() {
        assert_eq!(*p, &payloads[i][..]);
        assert_eq!(*end, ends[i]);
    }
    // Zeroed space after the log ends it.
    let mut padded = dev.clone();
    padded.extend(vec![0u8; 4096]);
    assert_eq!(aof::records(&padded).count(), 50);
    assert_eq!(aof::records(&padded).last().unwrap().1, dev.len());
    // A truncation anywhere keeps exactly the whole records before it.
    for cut in 0..dev.len() {
        let n = aof::records(&dev[..cut]).count();
        assert_eq!(n, ends.iter().filter(|&&e| e <= cut).count(), "cut at {cut}");
    }
    // A flipped bit stops at the damaged record, even if later ones are fine.
    for (i, &end) in ends.iter().enumerate().step_by(7) {
        let mut bad = dev.clone();
        bad[end - 1] ^= 0x10;
        assert_eq!(aof::records(&bad).count(), i);
        let start = if i == 0 { 0 } else { ends[i - 1] };
        let mut bad = dev.clone();
        bad[start + 5] ^= 1; // in the checksum
        assert_eq!(aof::records(&bad).count(), i);
        let mut bad = dev.clone();
        bad[start] ^= 1; // in the length
        assert_eq!(aof::records(&bad).count(), i);
    }
    assert_eq!(aof::records(&[]).count(), 0);
    assert_eq!(aof::records(&[1, 0, 0]).count(), 0);
    // A huge length field in garbage is just a torn tail.
    assert_eq!(aof::records(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 1]).count(), 0);
}

#[test]
fn crc32_is_the_standard_one() {
    // Known values, the catalogue check value for "123456789" among them:
    // records carry this checksum, so logs written by earlier builds stay
    // readable only while it is exactly this CRC-32.
    assert_eq!(aof::crc32(b""), 0);
    assert_eq!(aof::crc32(b"123456789"), 0xcbf4_3926);
    assert_eq!(aof::crc32(b"The quick brown fox jumps over the lazy dog"), 0x414f_a339);
    // The bytewise definition agrees at every length, across the lengths at
    // which an implementation switches between its bulk and tail loops.
    let data: Vec<u8> = (0..300u32).map(|i| (i * 31 + 7) as u8).collect();
    for n in 0..data.len() {
        let mut crc = !0u32;
        for &b in &data[..n] {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 { 0xedb8_8320 ^ (crc >> 1) } else { crc >> 1 };
            }
        }
        assert_eq!(aof::crc32(&data[..n]), !crc);
    }
}

/// The whole path: log to a device through aof framing, "reboot", replay.
#[test]
fn log_device_to_replay() {
    struct Device(Vec<u8>);
    impl LogSink for Device {
        fn append(&mut self, record: &[u8]) -> Result<(), LogError> {
            if self.0.len() > 2000 {
                return Err(LogError::Full);
            }
            aof::encode(record, &mut self.0);
            Ok(())
        }
    }
    let mut srv = Server::new();
    let mut conn = ftvm_kv::Connection::new();
    let mut dev = Device(Vec::new());
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        out.clear();
        let k = format!("k{}", i % 13);
        srv.handle(&mut conn, &resp(&[b"APPEND", k.as_bytes(), b"0123456789"]), i, &mut dev, &mut out);
        if out.starts_with(b"-ERR disk full") {
            break;
        }
        i += 1;
    }
    let mut fresh = Server::new();
    for (rec, _) in aof::records(&dev.0) {
        fresh.replay(rec, 1_000_000).unwrap();
    }
    assert_eq!(dump(&mut fresh, 1_000_000), dump(&mut srv, 1_000_000));
    let _ = MemLog::default();
}
