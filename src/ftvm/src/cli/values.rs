//! The checks clap runs on option values before anything starts, shared by
//! every subcommand (the demo's too); durations come out as [`Duration`]s
//! from the same text as ever (`--epoch-ms 20`, `--timeout 1.5`).

use std::time::Duration;

use clap::builder::TypedValueParser;

/// Shortest checkpoint interval: every epoch pauses the guest and waits for
/// a round trip, so shorter ones spend the VM's time on checkpoints.
pub const MIN_EPOCH_MS: u64 = 5;
/// Longest: output waits up to an epoch before it leaves.
pub const MAX_EPOCH_MS: u64 = 60_000;

/// A default duration as the text its option takes (`as_millis` for an
/// `--*-ms` option, `as_micros` for `--*-us`, `as_secs_f64` for seconds),
/// for clap's `default_value` and `[default: ..]`: the default itself is
/// the one constant.
macro_rules! default_text {
    ($default:expr, $unit:ident) => {{
        static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        TEXT.get_or_init(|| $default.$unit().to_string()).as_str()
    }};
}
pub(crate) use default_text;

/// `--epoch-ms`, `--sync-ms`: an interval between [`MIN_EPOCH_MS`] and [`MAX_EPOCH_MS`].
pub fn epoch_ms(s: &str) -> Result<Duration, String> {
    let ms: u64 = s.parse().map_err(|e| format!("not a number of milliseconds: {e}"))?;
    if !(MIN_EPOCH_MS..=MAX_EPOCH_MS).contains(&ms) {
        return Err(format!(
            "the checkpoint interval must be at least {MIN_EPOCH_MS} ms (each epoch pauses the guest for a checkpoint) and at most {MAX_EPOCH_MS} ms"
        ));
    }
    Ok(Duration::from_millis(ms))
}

/// A number of milliseconds, 0 included.
pub fn millis() -> impl TypedValueParser<Value = Duration> {
    clap::value_parser!(u64).map(Duration::from_millis)
}

/// A number of milliseconds that must be at least 1.
pub fn positive_ms(s: &str) -> Result<Duration, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1 ms".into()),
        Ok(n) => Ok(Duration::from_millis(n)),
        Err(e) => Err(format!("not a number of milliseconds: {e}")),
    }
}

/// `HOST:PORT` (a name, an IPv4 address or a bracketed IPv6 one), checked
/// for its shape at start rather than when it is first dialled (a standby,
/// say, only after a takeover).
pub fn host_port(s: &str) -> Result<String, String> {
    let (host, port) = s.rsplit_once(':').ok_or("not HOST:PORT")?;
    port.parse::<u16>().map_err(|_| format!("{port:?} is not a port (0 to 65535)"))?;
    let bracketed = host.starts_with('[') && host.ends_with(']');
    if host.is_empty() || (host.contains(':') && !bracketed) || host.chars().any(char::is_whitespace) {
        return Err(format!("{host:?} is not a host name or address"));
    }
    Ok(s.to_string())
}

/// An etcd endpoint: `http://HOST:PORT`.
pub fn arbiter_url(s: &str) -> Result<String, String> {
    let rest = s.strip_prefix("http://").ok_or("not http://HOST:PORT")?;
    host_port(rest.trim_end_matches('/'))?;
    Ok(s.to_string())
}

/// A count that must be at least 1.
pub fn at_least_one(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A number of seconds greater than zero.
pub fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        Ok(_) => Err("must be a number of seconds greater than 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// `ID=HOST:PORT`: a replica and its address (`ftvm replica-replace --add`).
pub fn member(s: &str) -> Result<(u64, String), String> {
    let (id, addr) = s.split_once('=').ok_or_else(|| format!("`{s}` is not ID=HOST:PORT"))?;
    let id: u64 = id.trim().parse().map_err(|_| format!("`{id}` is not a replica id (a number from 1)"))?;
    if id == 0 {
        return Err("replica ids start at 1".into());
    }
    let addr = addr.trim();
    if !addr.contains(':') {
        return Err(format!("`{addr}` is not HOST:PORT"));
    }
    Ok((id, addr.to_string()))
}

/// A client timeout in seconds (fractions allowed), at most a day.
pub fn timeout(s: &str) -> Result<Duration, String> {
    let secs = positive_seconds(s)?;
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| *d <= Duration::from_secs(86_400))
        .ok_or_else(|| "must be at most 86400 seconds".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_checks() {
        assert!(epoch_ms("0").unwrap_err().contains("at least 5 ms"));
        assert!(epoch_ms("4").is_err());
        assert_eq!(epoch_ms("5"), Ok(Duration::from_millis(5)));
        assert!(epoch_ms("60001").is_err());
        assert!(positive_ms("0").unwrap_err().contains("at least 1 ms"));
        assert!(positive_ms("x").is_err());
        assert_eq!(positive_ms("30"), Ok(Duration::from_millis(30)));
        assert!(at_least_one("0").is_err());
        assert_eq!(at_least_one("3"), Ok(3));
        assert!(positive_seconds("0").is_err() && positive_seconds("-1").is_err() && positive_seconds("nan").is_err());
        assert_eq!(timeout("1.5"), Ok(Duration::from_millis(1500)));
        assert!(timeout("inf").is_err() && timeout("1e9").is_err());
        for good in ["10.0.0.1:7000", "h2.example:7000", "localhost:1", "[::1]:65535"] {
            assert_eq!(host_port(good).as_deref(), Ok(good));
        }
        for bad in ["garbage", ",", ":7000", "h2:65536", "h2:port", "::1:7000", "a b:7000", "h2:"] {
            assert!(host_port(bad).is_err(), "{bad:?} accepted");
        }
        assert!(arbiter_url("http://10.0.0.3:2379/").is_ok());
        assert!(arbiter_url("garbage").is_err() && arbiter_url("http://h3").is_err() && arbiter_url("10.0.0.3:2379").is_err());
    }

    #[test]
    fn defaults_read_back_as_their_values() {
        let epoch = ftvm_primary_backup::PrimaryConfig::DEFAULT_EPOCH;
        assert_eq!(epoch_ms(default_text!(epoch, as_millis)), Ok(epoch));
        assert_eq!(timeout(default_text!(Duration::from_secs(600), as_secs_f64)), Ok(Duration::from_secs(600)));
    }
}
