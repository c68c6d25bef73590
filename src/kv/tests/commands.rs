//! Every command's replies, happy paths and errors, compared byte for byte
//! with what Redis 7 sends.

mod common;
use common::{resp, words, H};

#[test]
fn ping_echo_select() {
    let mut h = H::new();
    h.replies(&[
        ("PING", "+PONG\r\n"),
        ("ping hello", "$5\r\nhello\r\n"),
        ("PING a b", "-ERR wrong number of arguments for 'ping' command\r\n"),
        ("ECHO hi", "$2\r\nhi\r\n"),
        ("echo", "-ERR wrong number of arguments for 'echo' command\r\n"),
        ("SELECT 0", "+OK\r\n"),
        ("SELECT 1", "-ERR DB index is out of range\r\n"),
        ("SELECT x", "-ERR value is not an integer or out of range\r\n"),
    ]);
}

#[test]
fn unknown_command_and_arity() {
    let mut h = H::new();
    assert_eq!(h.cmd("FOO"), "-ERR unknown command 'FOO', with args beginning with: \r\n");
    assert_eq!(h.cmd("foo a b"), "-ERR unknown command 'foo', with args beginning with: 'a' 'b' \r\n");
    let long = "x".repeat(200);
    let out = h.cmd(&format!("foo {long} y"));
    assert_eq!(out, format!("-ERR unknown command 'foo', with args beginning with: '{}' \r\n", "x".repeat(128)));
    // Newlines in an error would break the reply framing.
    let out = h.args(&[b"bad\r\nname"]);
    assert_eq!(out, "-ERR unknown command 'bad  name', with args beginning with: \r\n");
    assert_eq!(
        h.cmd("averyveryverylongcommandname"),
        "-ERR unknown command 'averyveryverylongcommandname', with args beginning with: \r\n"
    );
    h.replies(&[
        ("GET", "-ERR wrong number of arguments for 'get' command\r\n"),
        ("GET a b", "-ERR wrong number of arguments for 'get' command\r\n"),
        ("SET a", "-ERR wrong number of arguments for 'set' command\r\n"),
        ("DEL", "-ERR wrong number of arguments for 'del' command\r\n"),
        ("DBSIZE x", "-ERR wrong number of arguments for 'dbsize' command\r\n"),
        ("MSET a", "-ERR wrong number of arguments for 'mset' command\r\n"),
        ("MSET a 1 b", "-ERR wrong number of arguments for 'mset' command\r\n"),
    ]);
    assert!(h.log.records.is_empty());
}

#[test]
fn set_get_del_exists() {
    let mut h = H::new();
    h.replies(&[("GET k", "$-1\r\n"), ("SET k v", "+OK\r\n"), ("get k", "$1\r\nv\r\n")]);
    assert_eq!(h.args(&[b"SET", b"bin\0", b"a\r\nb"]), "+OK\r\n");
    assert_eq!(h.args(&[b"GET", b"bin\0"]), "$4\r\na\r\nb\r\n");
    assert_eq!(h.args(&[b"SET", b"empty", b""]), "+OK\r\n");
    h.replies(&[
        ("GET empty", "$0\r\n\r\n"),
        ("EXISTS k k nope", ":2\r\n"),
        ("DEL k k nope", ":1\r\n"),
        ("EXISTS k", ":0\r\n"),
        ("DEL k", ":0\r\n"),
        ("DBSIZE", ":2\r\n"),
    ]);
    assert_eq!(h.srv.dbsize(), 2);
}

#[test]
fn set_nx_xx_get_keepttl() {
    let mut h = H::new();
    h.replies(&[
        ("SET k v XX", "$-1\r\n"),
        ("EXISTS k", ":0\r\n"),
        ("SET k v NX", "+OK\r\n"),
        ("SET k w NX", "$-1\r\n"),
        ("GET k", "$1\r\nv\r\n"),
        ("SET k w xx", "+OK\r\n"),
        ("GET k", "$1\r\nw\r\n"),
        ("SET k x GET", "$1\r\nw\r\n"),
        ("SET new x GET", "$-1\r\n"),
        ("SET k y NX GET", "$1\r\nx\r\n"),
        ("GET k", "$1\r\nx\r\n"),
        ("SET k v NX XX", "-ERR syntax error\r\n"),
        ("SET k v XX NX", "-ERR syntax error\r\n"),
        ("SET k v NX NX", "$-1\r\n"),
        ("SET k v FOO", "-ERR syntax error\r\n"),
        ("SET k v EX", "-ERR syntax error\r\n"),
        ("SET k v EX 1 PX 1", "-ERR syntax error\r\n"),
        ("SET k v PXAT 1 PX 1", "-ERR syntax error\r\n"),
        ("SET r v EX 1 EX 20", "+OK\r\n"),
        ("TTL r", ":20\r\n"),
        ("SET k v EX 1 KEEPTTL", "-ERR syntax error\r\n"),
        ("SET k v KEEPTTL EX 1", "-ERR syntax error\r\n"),
        ("SET k v EX x", "-ERR value is not an integer or out of range\r\n"),
        ("SET k v EX 0", "-ERR invalid expire time in 'set' command\r\n"),
        ("SET k v PX -5", "-ERR invalid expire time in 'set' command\r\n"),
        ("SET k v EX 9223372036854775807", "-ERR invalid expire time in 'set' command\r\n"),
        ("SET k v PX 9223372036854775807", "-ERR invalid expire time in 'set' command\r\n"),
        ("GET k", "$1\r\nx\r\n"),
        // KEEPTTL keeps, a plain SET clears.
        ("SET t v EX 100", "+OK\r\n"),
        ("SET t w KEEPTTL", "+OK\r\n"),
        ("TTL t", ":100\r\n"),
        ("SET t w XX", "+OK\r\n"),
        ("TTL t", ":-1\r\n"),
    ]);
}

#[test]
fn expiry_follows_now() {
    let mut h = H::new();
    let t0 = h.now;
    assert_eq!(h.cmd("SET a 1 EX 10"), "+OK\r\n");
    assert_eq!(h.cmd("SET b 2 PX 1500"), "+OK\r\n");
    assert_eq!(h.cmd(&format!("SET c 3 PXAT {}", t0 + 3000)), "+OK\r\n");
    assert_eq!(h.cmd(&format!("SET d 4 EXAT {}", t0 / 1000 + 4)), "+OK\r\n");
    h.replies(&[
        ("SET e 5", "+OK\r\n"),
        ("TTL a", ":10\r\n"),
        ("PTTL b", ":1500\r\n"),
        ("TTL b", ":2\r\n"), // rounded, as Redis does
        ("TTL e", ":-1\r\n"),
        ("TTL nope", ":-2\r\n"),
        ("PTTL nope", ":-2\r\n"),
        ("DBSIZE", ":5\r\n"),
    ]);
    assert!(h.cmd("INFO keyspace").contains("db0:keys=5,expires=4,avg_ttl=0\r\n"));

    h.now = t0 + 1499;
    assert_eq!(h.cmd("GET b"), "$1\r\n2\r\n");
    h.now = t0 + 1500;
    h.replies(&[("GET b", "$-1\r\n"), ("EXISTS b", ":0\r\n"), ("DBSIZE", ":4\r\n")]);
    h.now = t0 + 3500;
    assert_eq!(h.cmd("MGET a b c d e"), "*5\r\n$1\r\n1\r\n$-1\r\n$-1\r\n$1\r\n4\r\n$1\r\n5\r\n");
    assert_eq!(h.srv.dbsize(), 3);
    h.now = t0 + 10_000;
    h.replies(&[
        ("DBSIZE", ":1\r\n"),
        ("KEYS *", "*1\r\n$1\r\ne\r\n"),
        // An absolute time already past leaves no key.
        ("SET p v PXAT 5", "+OK\r\n"),
        ("EXISTS p", ":0\r\n"),
        ("DBSIZE", ":1\r\n"),
    ]);
    // An expired key is absent for NX, INCR and APPEND.
    assert_eq!(h.cmd("SET x 5 PX 10"), "+OK\r\n");
    h.now += 10;
    assert_eq!(h.cmd("SET x 6 NX"), "+OK\r\n");
    assert_eq!(h.cmd("TTL x"), ":-1\r\n");
    assert_eq!(h.cmd("SET y 5 PX 10"), "+OK\r\n");
    h.now += 10;
    assert_eq!(h.cmd("INCR y"), ":1\r\n");
    assert_eq!(h.cmd("SET z ab PX 10"), "+OK\r\n");
    h.now += 10;
    assert_eq!(h.cmd("APPEND z c"), ":1\r\n");
    assert_eq!(h.cmd("TTL z"), ":-1\r\n");
    assert!(h.cmd("INFO stats").contains("expired_keys:"));
}

#[test]
fn expire_sweeps_without_commands() {
    let mut h = H::new();
    for i in 0..100 {
        h.cmd(&format!("SET k{i} v PX {}", 10 + i));
    }
    h.cmd("SET keep v");
    assert_eq!(h.srv.dbsize(), 101);
    assert_eq!(h.srv.expire(h.now + 59), 50);
    assert_eq!(h.srv.dbsize(), 51);
    // Re-setting one key many times leaves stale timers that must not pile up
    // or expire the key early.
    for i in 0..5000u64 {
        h.now += 1;
        h.cmd(&format!("SET hot v PX {}", 1000 + i));
    }
    assert_eq!(h.cmd("EXISTS hot"), ":1\r\n");
    h.now += 5998;
    assert_eq!(h.cmd("EXISTS hot"), ":1\r\n");
    h.now += 1;
    assert_eq!(h.cmd("EXISTS hot"), ":0\r\n");
    assert_eq!(h.cmd("DBSIZE"), ":1\r\n");
}

#[test]
fn incr_family() {
    let mut h = H::new();
    h.replies(&[
        ("INCR n", ":1\r\n"),
        ("INCRBY n 10", ":11\r\n"),
        ("DECR n", ":10\r\n"),
        ("DECRBY n 20", ":-10\r\n"),
        ("GET n", "$3\r\n-10\r\n"),
        ("INCRBY n x", "-ERR value is not an integer or out of range\r\n"),
        ("INCRBY n 1.5", "-ERR value is not an integer or out of range\r\n"),
        ("INCRBY n 99999999999999999999", "-ERR value is not an integer or out of range\r\n"),
    ]);
    for bad in ["abc", "01", " 1", "+1", "-0", "1 ", ""] {
        h.args(&[b"SET", b"s", bad.as_bytes()]);
        assert_eq!(h.cmd("INCR s"), "-ERR value is not an integer or out of range\r\n", "{bad:?}");
    }
    h.cmd("SET big 9223372036854775807");
    h.replies(&[
        ("INCR big", "-ERR increment or decrement would overflow\r\n"),
        ("DECRBY big -1", "-ERR increment or decrement would overflow\r\n"),
        ("GET big", "$19\r\n9223372036854775807\r\n"),
    ]);
    h.cmd("SET small -9223372036854775808");
    h.replies(&[
        ("DECR small", "-ERR increment or decrement would overflow\r\n"),
        ("INCRBY small -1", "-ERR increment or decrement would overflow\r\n"),
        ("DECRBY x -9223372036854775808", "-ERR decrement would overflow\r\n"),
        ("INCRBY small 9223372036854775807", ":-1\r\n"),
    ]);
    h.cmd("SET huge 9223372036854775808");
    assert_eq!(h.cmd("INCR huge"), "-ERR value is not an integer or out of range\r\n");
    // INCR keeps the key's time to live.
    h.cmd("SET t 1 EX 50");
    h.replies(&[
        ("INCR t", ":2\r\n"),
        ("TTL t", ":50\r\n"),
        ("INCR", "-ERR wrong number of arguments for 'incr' command\r\n"),
        ("INCRBY n", "-ERR wrong number of arguments for 'incrby' command\r\n"),
    ]);
}

#[test]
fn append_strlen_mset_mget() {
    let mut h = H::new();
    h.replies(&[
        ("APPEND a hello", ":5\r\n"),
        ("APPEND a _world", ":11\r\n"),
        ("GET a", "$11\r\nhello_world\r\n"),
        ("STRLEN a", ":11\r\n"),
        ("STRLEN nope", ":0\r\n"),
    ]);
    h.cmd("SET t x EX 9");
    h.replies(&[
        ("APPEND t y", ":2\r\n"),
        ("TTL t", ":9\r\n"),
        ("MSET a 1 b 2 c 3", "+OK\r\n"),
        ("TTL t", ":9\r\n"),
        ("MSET t 1", "+OK\r\n"),
        ("TTL t", ":-1\r\n"),
        ("MGET a b nope c", "*4\r\n$1\r\n1\r\n$1\r\n2\r\n$-1\r\n$1\r\n3\r\n"),
        ("MGET", "-ERR wrong number of arguments for 'mget' command\r\n"),
        ("APPEND a", "-ERR wrong number of arguments for 'append' command\r\n"),
    ]);
}

#[test]
fn keys_glob() {
    let mut h = H::new();
    h.cmd("MSET hello 1 hallo 2 hxllo 3 hllo 4 heeeello 5 h*llo 6");
    fn keys_of(h: &mut H, p: &str) -> Vec<String> {
        let out = h.args(&[b"KEYS", p.as_bytes()]);
        let mut v: Vec<String> = out.split("\r\n").filter(|l| !l.is_empty() && !l.starts_with(['*', '$'])).map(String::from).collect();
        v.sort();
        v
    }
    assert_eq!(keys_of(&mut h, "h?llo"), ["h*llo", "hallo", "hello", "hxllo"]);
    assert_eq!(keys_of(&mut h, "h*llo"), ["h*llo", "hallo", "heeeello", "hello", "hllo", "hxllo"]);
    assert_eq!(keys_of(&mut h, "h[ae]llo"), ["hallo", "hello"]);
    assert_eq!(keys_of(&mut h, "h[^e]llo"), ["h*llo", "hallo", "hxllo"]);
    assert_eq!(keys_of(&mut h, "h[a-b]llo"), ["hallo"]);
    assert_eq!(keys_of(&mut h, "h[b-a]llo"), ["hallo"]);
    assert_eq!(keys_of(&mut h, "h\\*llo"), ["h*llo"]);
    assert_eq!(keys_of(&mut h, "*"), ["h*llo", "hallo", "heeeello", "hello", "hllo", "hxllo"]);
    assert_eq!(keys_of(&mut h, "nomatch*"), Vec::<String>::new());
    assert_eq!(keys_of(&mut h, "h[ae"), Vec::<String>::new());
    // Pathological patterns stay fast.
    h.args(&[b"SET", "a".repeat(5000).as_bytes(), b"v"]);
    assert!(keys_of(&mut h, &format!("{}b", "*a".repeat(50))).is_empty());
}

#[test]
fn flush() {
    let mut h = H::new();
    h.cmd("MSET a 1 b 2");
    assert_eq!(h.cmd("FLUSHDB"), "+OK\r\n");
    assert_eq!(h.cmd("DBSIZE"), ":0\r\n");
    h.cmd("SET a 1 EX 5");
    h.replies(&[
        ("FLUSHALL ASYNC", "+OK\r\n"),
        ("FLUSHALL sync", "+OK\r\n"),
        ("FLUSHALL now", "-ERR syntax error\r\n"),
        ("FLUSHDB a b", "-ERR syntax error\r\n"),
        ("DBSIZE", ":0\r\n"),
    ]);
    assert!(h.cmd("INFO").contains("db0:keys=0,expires=0,avg_ttl=0\r\n"));
}

#[test]
fn info_config_command_client() {
    let mut h = H::new();
    h.cmd("SET a 1");
    let info = h.cmd("INFO");
    let body = info.split_once("\r\n").unwrap().1;
    assert_eq!(info, format!("${}\r\n{body}", body.len() - 2));
    assert!(body.starts_with("# Server\r\nredis_version:7.0.0\r\n"), "{body}");
    assert!(body.contains("\r\n\r\n# Keyspace\r\ndb0:keys=1,expires=0,avg_ttl=0\r\n"), "{body}");
    assert!(body.contains("aof_enabled:0\r\n"));
    assert!(body.contains("total_commands_processed:"));
    let server = h.cmd("info SERVER");
    assert!(server.contains("redis_version:7.0.0") && !server.contains("Keyspace"));
    assert_eq!(h.cmd("INFO nosuchsection"), "$0\r\n\r\n");
    assert!(h.cmd("INFO server keyspace").contains("# Keyspace"));

    assert_eq!(h.cmd("CONFIG GET save"), "*2\r\n$4\r\nsave\r\n$0\r\n\r\n");
    assert_eq!(h.cmd("CONFIG GET appendonly"), "*2\r\n$10\r\nappendonly\r\n$2\r\nno\r\n");
    h.srv.set_appendonly(true);
    assert_eq!(h.cmd("config get APPENDONLY"), "*2\r\n$10\r\nappendonly\r\n$3\r\nyes\r\n");
    assert!(h.cmd("INFO persistence").contains("aof_enabled:1\r\n"));
    assert_eq!(h.cmd("CONFIG GET nosuch"), "*0\r\n");
    assert_eq!(h.cmd("CONFIG GET save appendonly").matches('$').count(), 4);
    assert_eq!(h.cmd("CONFIG GET *").matches('$').count(), 6);
    h.replies(&[
        ("CONFIG GET", "-ERR wrong number of arguments for 'config|get' command\r\n"),
        ("CONFIG", "-ERR wrong number of arguments for 'config' command\r\n"),
        ("CONFIG SET save x", "-ERR unknown subcommand 'SET'. Try CONFIG HELP.\r\n"),
    ]);

    h.replies(&[
        ("COMMAND", "*0\r\n"),
        ("COMMAND DOCS", "*0\r\n"),
        ("COMMAND DOCS get", "*0\r\n"),
        ("COMMAND COUNT", ":27\r\n"),
        ("COMMAND FOO", "-ERR unknown subcommand 'FOO'. Try COMMAND HELP.\r\n"),
    ]);

    h.replies(&[
        ("CLIENT SETNAME bench", "+OK\r\n"),
        ("CLIENT SETINFO lib-name redis-py", "+OK\r\n"),
        ("CLIENT GETNAME", "$-1\r\n"),
        ("CLIENT SETNAME", "-ERR wrong number of arguments for 'client|setname' command\r\n"),
        ("CLIENT KILL x", "-ERR unknown subcommand 'KILL'. Try CLIENT HELP.\r\n"),
        ("CLIENT", "-ERR wrong number of arguments for 'client' command\r\n"),
    ]);
    assert!(h.log.records.len() == 1, "only the SET is logged");
}

#[test]
fn quit_closes_after_reply() {
    let mut h = H::new();
    let mut input = common::resp(&[b"SET", b"a", b"1"]);
    input.extend(common::resp(&[b"QUIT"]));
    input.extend(common::resp(&[b"SET", b"b", b"2"]));
    let (out, flow) = h.feed(&input);
    assert_eq!(out, "+OK\r\n+OK\r\n");
    assert_eq!(flow, ftvm_kv::Flow::Close);
    assert!(h.conn.is_closing());
    // Nothing more runs on a closed connection.
    let (out, flow) = h.feed(&common::resp(&[b"SET", b"c", b"3"]));
    assert_eq!((out.as_str(), flow), ("", ftvm_kv::Flow::Close));
    assert_eq!(h.srv.dbsize(), 1);
    // Other connections carry on.
    h.conn = ftvm_kv::Connection::new();
    assert_eq!(h.cmd("GET a"), "$1\r\n1\r\n");
}

#[test]
fn time_reports_the_clock_in_seconds_and_microseconds() {
    let mut h = H::new();
    // `handle` has millisecond resolution.
    h.now = 12_345;
    assert_eq!(h.cmd("TIME"), "*2\r\n$2\r\n12\r\n$6\r\n345000\r\n");
    assert_eq!(h.cmd("time"), h.cmd("TIME"));
    assert_eq!(h.cmd("TIME now"), "-ERR wrong number of arguments for 'time' command\r\n");
    // `handle_us` passes microseconds through; expiry follows them in ms.
    let mut out = Vec::new();
    let mut run = |h: &mut H, cmd: &str, now_us: u64| {
        out.clear();
        let input = resp(&words(cmd));
        h.srv.handle_us(&mut h.conn, &input, now_us, &mut h.log, &mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    assert_eq!(run(&mut h, "SET k v PX 10", 5_000_000), "+OK\r\n");
    assert_eq!(run(&mut h, "GET k", 5_009_999), "$1\r\nv\r\n");
    assert_eq!(run(&mut h, "GET k", 5_010_000), "$-1\r\n", "expired at 5010 ms");
    for (now_us, reply) in [
        (7_000_001, "*2\r\n$1\r\n7\r\n$1\r\n1\r\n"),
        (0, "*2\r\n$1\r\n0\r\n$1\r\n0\r\n"),
        (u64::MAX, "*2\r\n$14\r\n18446744073709\r\n$6\r\n551615\r\n"),
    ] {
        assert_eq!(run(&mut h, "TIME", now_us), reply, "at {now_us} us");
    }
    assert_eq!(h.log.records.len(), 1, "TIME logs nothing");
}

static FREE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

fn free() -> usize {
    FREE.load(std::sync::atomic::Ordering::Relaxed)
}

/// A write that would leave less than the reserve free is refused with
/// Redis's `-OOM`, neither logged nor applied; reads, deletes and writes
/// go on once memory is back.
#[test]
fn writes_are_refused_when_memory_runs_out() {
    use std::sync::atomic::Ordering;
    let mut h = H::new();
    h.srv.set_free_memory(free);
    assert_eq!(h.cmd("SET a 1"), "+OK\r\n");
    FREE.store(ftvm_kv::MEMORY_RESERVE + 200, Ordering::Relaxed);
    assert_eq!(h.cmd("SET b 12"), "+OK\r\n", "a small key and value fit above the reserve");
    let big = "v".repeat(200);
    assert!(h.cmd(&format!("SET b {big}")).starts_with("-OOM "), "a value that would eat into the reserve");
    FREE.store(ftvm_kv::MEMORY_RESERVE + 10, Ordering::Relaxed);
    let records = h.log.records.len();
    for write in ["SET c 123", "SET a 123", "INCR n", "APPEND a xyz", "MSET x 1 y 2"] {
        let reply = h.cmd(write);
        assert!(reply.starts_with("-OOM command not allowed when used memory > 'maxmemory'"), "{write}: {reply}");
    }
    assert_eq!(h.log.records.len(), records, "a refused write is not logged");
    h.replies(&[("GET a", "$1\r\n1\r\n"), ("EXISTS c n x", ":0\r\n"), ("DEL b", ":1\r\n")]);
    assert!(h.cmd("INFO stats").contains("oom_refused_writes:6\r\n"));
    FREE.store(usize::MAX, Ordering::Relaxed);
    assert_eq!(h.cmd("SET c 123"), "+OK\r\n");
}
