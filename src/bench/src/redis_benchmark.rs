//! redis-benchmark's `--csv` output, as the kv and ft benchmarks read it,
//! and one run of it from a topology's client namespace.

use std::process::Stdio;

use ftvm_testkit::topology::Topology;

type BoxError = Box<dyn std::error::Error>;

/// One test's line (SET, GET).
#[derive(Clone, Debug)]
pub struct Figures {
    pub test: String,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Every test line of `csv`, its columns found by the header's names.
pub fn parse(csv: &str) -> Result<Vec<Figures>, BoxError> {
    let unquote = |s: &str| s.trim().trim_matches('"').to_owned();
    let mut lines = csv.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<String> = lines.next().ok_or("redis-benchmark printed nothing")?.split(',').map(unquote).collect();
    let col = |name: &str| header.iter().position(|h| h == name).ok_or_else(|| format!("no {name} column in {header:?}"));
    let (rps, p50, p99) = (col("rps")?, col("p50_latency_ms")?, col("p99_latency_ms")?);
    let mut rows = Vec::new();
    for line in lines {
        let cols: Vec<String> = line.split(',').map(unquote).collect();
        let num = |i: usize| -> Result<f64, BoxError> {
            cols.get(i).and_then(|v| v.parse().ok()).ok_or_else(|| format!("bad redis-benchmark line {line:?}").into())
        };
        rows.push(Figures { test: cols[0].clone(), rps: num(rps)?, p50_ms: num(p50)?, p99_ms: num(p99)? });
    }
    Ok(rows)
}

/// redis-benchmark from `topo`'s client namespace against `host` port
/// 6379, given up after 300 s: `tests` (SET, GET), with `args` (counts,
/// connections, depth). Their lines, in the order asked; a failed run, one
/// that printed an error, or a missing line is an error carrying all it
/// printed.
pub fn run(topo: &Topology, host: &str, tests: &[&str], args: &[String]) -> Result<Vec<Figures>, BoxError> {
    let out = topo
        .command("client", "timeout")
        .args(["300", "redis-benchmark", "-h", host, "-p", "6379", "-t", &tests.join(",").to_lowercase(), "--csv"])
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() || all.to_lowercase().contains("error") {
        return Err(format!("redis-benchmark against {host} failed ({}): {all}", out.status).into());
    }
    let rows = parse(&String::from_utf8_lossy(&out.stdout))?;
    tests.iter().map(|t| rows.iter().find(|f| f.test == *t).cloned().ok_or_else(|| format!("no {t} line: {all}").into())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_7_csv() {
        let csv = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                   \"SET\",\"714285.69\",\"0.795\",\"0.312\",\"0.815\",\"1.127\",\"1.375\",\"24.191\"\n\
                   \"GET\",\"746268.62\",\"0.768\",\"0.336\",\"0.799\",\"1.103\",\"1.679\",\"2.063\"\n";
        let rows = parse(csv).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].test.as_str(), rows[0].rps, rows[0].p50_ms, rows[0].p99_ms), ("SET", 714285.69, 0.815, 1.375));
        assert_eq!((rows[1].test.as_str(), rows[1].rps, rows[1].p99_ms), ("GET", 746268.62, 1.679));
        assert!(parse("\"test\",\"rps\"\n").is_err());
        assert!(parse("").is_err());
    }
}
