//! redis-benchmark's `--csv` output, as the kv and ft benchmarks read it.

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
