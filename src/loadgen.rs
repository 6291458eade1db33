//! `quiver bench`: a short load run against a running server.
//!
//! Two modes. Open loop (`--rate R`): each connection sends on a fixed
//! schedule whatever the server does, and latency is measured from each
//! request's *intended* send time, so a stalled server shows up in the tail
//! (coordinated omission corrected). Closed loop (no `--rate`): each
//! connection keeps a fixed number of requests in flight; it measures
//! service time, not latency under a given load, and is labelled as such.
//! The full benchmark suite (sweeps, plots, floors) builds on this.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::client::{ClientError, Codec};
use crate::demo::Workload;
use crate::wire::{status_name, tier_name, RequestSpec, Response};

/// Most requests one run may schedule, so a typo in `--rate` cannot exhaust memory.
pub const REQUESTS_MAX: u64 = 50_000_000;
/// Longest time to wait for stragglers after the sending phase.
const DRAIN_MAX: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub addr: String,
    pub duration: Duration,
    pub connections: usize,
    /// Total offered rate in requests per second; `None` for closed loop.
    pub rate: Option<f64>,
    /// Requests in flight per connection in closed loop.
    pub pipeline: usize,
    pub seed: u64,
    pub candidates: usize,
    pub unknown_fraction: f64,
    pub budget_us: u32,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub p9999_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub mode: &'static str,
    pub connections: usize,
    pub duration_s: f64,
    pub offered_rate: Option<f64>,
    pub achieved_rate: f64,
    pub sent: u64,
    pub received: u64,
    pub lost: u64,
    pub connection_errors: Vec<String>,
    pub by_status: BTreeMap<String, u64>,
    pub by_tier: BTreeMap<String, u64>,
    pub latency: Latency,
    /// Open loop only: sends that left more than 1 ms after their intended
    /// time, i.e. the generator itself fell behind.
    pub late_sends: u64,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("static bounds are valid")
}

struct ConnResult {
    hist: Histogram<u64>,
    sent: u64,
    received: u64,
    late_sends: u64,
    by_status: BTreeMap<String, u64>,
    by_tier: BTreeMap<String, u64>,
    error: Option<String>,
}

impl ConnResult {
    fn new() -> ConnResult {
        ConnResult {
            hist: histogram(),
            sent: 0,
            received: 0,
            late_sends: 0,
            by_status: BTreeMap::new(),
            by_tier: BTreeMap::new(),
            error: None,
        }
    }

    fn record(&mut self, resp: &Response, latency_us: u64) {
        self.received += 1;
        self.hist.saturating_record(latency_us.max(1));
        *self.by_status.entry(status_name(resp.status).into()).or_default() += 1;
        if resp.status == crate::wire::Status::Ok {
            *self.by_tier.entry(tier_name(resp.tier).into()).or_default() += 1;
        }
    }
}

/// Reads responses off a socket with the sans-IO codec.
struct Reader {
    stream: TcpStream,
    codec: Codec,
    buf: Vec<u8>,
    filled: usize,
}

impl Reader {
    fn new(stream: TcpStream) -> Reader {
        Reader {
            stream,
            codec: Codec::default(),
            buf: vec![0; 256 * 1024],
            filled: 0,
        }
    }

    /// The next response, or `Ok(None)` when `until` passes first.
    fn next(&mut self, until: Instant) -> Result<Option<Response>, ClientError> {
        loop {
            if let Some((resp, used)) = self.codec.decode(&self.buf[..self.filled])? {
                self.buf.copy_within(used..self.filled, 0);
                self.filled -= used;
                return Ok(Some(resp));
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            if self.filled == self.buf.len() {
                self.buf.resize(self.buf.len() * 2, 0);
            }
            self.stream.set_read_timeout(Some(left))?;
            match self.stream.read(&mut self.buf[self.filled..]) {
                Ok(0) => return Err(ClientError::Closed),
                Ok(n) => self.filled += n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Ok(None)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

fn workload(opts: &BenchOptions, conn: usize) -> Workload {
    let mut w = Workload::auction32(opts.seed.wrapping_add(conn as u64 * 0x9E37_79B9));
    w.candidates = opts.candidates;
    w.unknown_fraction = opts.unknown_fraction;
    w.budget_us = opts.budget_us;
    w
}

fn connect(addr: &str) -> Result<TcpStream, ClientError> {
    let s = TcpStream::connect(addr).map_err(|source| ClientError::Connect {
        addr: addr.into(),
        source,
    })?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn open_loop_conn(opts: &BenchOptions, conn: usize, rate_per_conn: f64, start: Instant) -> ConnResult {
    let mut result = ConnResult::new();
    let stream = match connect(&opts.addr) {
        Ok(s) => s,
        Err(e) => {
            result.error = Some(e.to_string());
            return result;
        }
    };
    let interval_ns = 1e9 / rate_per_conn;
    let planned = ((opts.duration.as_secs_f64() * rate_per_conn).ceil() as u64).clamp(1, REQUESTS_MAX);
    let intended_ns: Arc<Vec<AtomicU64>> = Arc::new((0..planned).map(|_| AtomicU64::new(0)).collect());
    let sent = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let mut reader = Reader::new(stream.try_clone().expect("cloning a connected socket"));

    let writer = {
        let (intended_ns, sent, done) = (intended_ns.clone(), sent.clone(), done.clone());
        let mut w = workload(opts, conn);
        let mut stream = stream;
        std::thread::spawn(move || -> (u64, Option<String>) {
            let mut codec = Codec::default();
            let (mut spec, mut buf, mut late) = (RequestSpec::default(), Vec::new(), 0u64);
            for seq in 0..planned {
                let due_ns = (seq as f64 * interval_ns) as u64;
                loop {
                    let now_ns = start.elapsed().as_nanos() as u64;
                    if now_ns >= due_ns {
                        late += u64::from(now_ns - due_ns > 1_000_000);
                        break;
                    }
                    let wait_ns = due_ns - now_ns;
                    if wait_ns > 200_000 {
                        std::thread::sleep(Duration::from_nanos(wait_ns - 100_000));
                    } else {
                        std::hint::spin_loop();
                    }
                }
                w.fill(seq, &mut spec);
                buf.clear();
                codec.encode(&spec, &mut buf);
                intended_ns[seq as usize].store(due_ns, Ordering::Release);
                if let Err(e) = stream.write_all(&buf) {
                    done.store(true, Ordering::Release);
                    return (late, Some(e.to_string()));
                }
                sent.store(seq + 1, Ordering::Release);
            }
            done.store(true, Ordering::Release);
            (late, None)
        })
    };

    let drain_until = start + opts.duration + DRAIN_MAX;
    loop {
        if done.load(Ordering::Acquire) && result.received >= sent.load(Ordering::Acquire) {
            break;
        }
        match reader.next(drain_until) {
            Ok(Some(resp)) => {
                let now_ns = start.elapsed().as_nanos() as u64;
                let Some(slot) = intended_ns.get(resp.request_id as usize) else {
                    result.error = Some(format!("response for unknown request {}", resp.request_id));
                    break;
                };
                let latency_us = now_ns.saturating_sub(slot.load(Ordering::Acquire)) / 1_000;
                result.record(&resp, latency_us);
            }
            Ok(None) => break,
            Err(e) => {
                result.error = Some(e.to_string());
                break;
            }
        }
    }
    let _ = reader.stream.shutdown(std::net::Shutdown::Both);
    let (late, write_error) = writer.join().expect("writer thread does not panic");
    result.late_sends = late;
    result.sent = sent.load(Ordering::Acquire);
    result.error = result.error.or(write_error);
    result
}

fn closed_loop_conn(opts: &BenchOptions, conn: usize, start: Instant) -> ConnResult {
    let mut result = ConnResult::new();
    let mut stream = match connect(&opts.addr) {
        Ok(s) => s,
        Err(e) => {
            result.error = Some(e.to_string());
            return result;
        }
    };
    let mut reader = Reader::new(stream.try_clone().expect("cloning a connected socket"));
    let mut w = workload(opts, conn);
    let mut codec = Codec::default();
    let (mut spec, mut buf) = (RequestSpec::default(), Vec::new());
    let window = opts.pipeline.max(1);
    let mut sent_at: Vec<Instant> = Vec::new();
    let end = start + opts.duration;
    let drain_until = end + DRAIN_MAX;
    loop {
        let now = Instant::now();
        while now < end && result.sent - result.received < window as u64 && result.sent < REQUESTS_MAX {
            w.fill(result.sent, &mut spec);
            buf.clear();
            codec.encode(&spec, &mut buf);
            sent_at.push(Instant::now());
            if let Err(e) = stream.write_all(&buf) {
                result.error = Some(e.to_string());
                return result;
            }
            result.sent += 1;
        }
        if result.received == result.sent {
            break;
        }
        match reader.next(drain_until) {
            Ok(Some(resp)) => {
                let Some(t) = sent_at.get(resp.request_id as usize) else {
                    result.error = Some(format!("response for unknown request {}", resp.request_id));
                    break;
                };
                let latency_us = t.elapsed().as_micros() as u64;
                result.record(&resp, latency_us);
            }
            Ok(None) => break,
            Err(e) => {
                result.error = Some(e.to_string());
                break;
            }
        }
    }
    result
}

/// Runs the load and merges every connection's results.
pub fn run(opts: &BenchOptions) -> BenchReport {
    let connections = opts.connections.max(1);
    let start = Instant::now() + Duration::from_millis(20);
    let results: Vec<ConnResult> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..connections)
            .map(|c| {
                s.spawn(move || match opts.rate {
                    Some(rate) => open_loop_conn(opts, c, rate / connections as f64, start),
                    None => closed_loop_conn(opts, c, start),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench threads do not panic"))
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    let mut hist = histogram();
    let mut report = BenchReport {
        mode: if opts.rate.is_some() {
            "open-loop"
        } else {
            "closed-loop"
        },
        connections,
        duration_s: opts.duration.as_secs_f64(),
        offered_rate: opts.rate,
        achieved_rate: 0.0,
        sent: 0,
        received: 0,
        lost: 0,
        connection_errors: Vec::new(),
        by_status: BTreeMap::new(),
        by_tier: BTreeMap::new(),
        latency: Latency::default(),
        late_sends: 0,
    };
    for r in results {
        hist.add(&r.hist).expect("same bounds");
        report.sent += r.sent;
        report.received += r.received;
        report.late_sends += r.late_sends;
        for (k, v) in r.by_status {
            *report.by_status.entry(k).or_default() += v;
        }
        for (k, v) in r.by_tier {
            *report.by_tier.entry(k).or_default() += v;
        }
        report.connection_errors.extend(r.error);
    }
    report.lost = report.sent - report.received.min(report.sent);
    // Wall time from the first scheduled send to the last response.
    report.achieved_rate = report.received as f64 / elapsed;
    report.latency = Latency {
        p50_us: hist.value_at_quantile(0.50),
        p90_us: hist.value_at_quantile(0.90),
        p99_us: hist.value_at_quantile(0.99),
        p999_us: hist.value_at_quantile(0.999),
        p9999_us: hist.value_at_quantile(0.9999),
        max_us: hist.max(),
        mean_us: hist.mean(),
    };
    report
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.offered_rate {
            Some(r) => writeln!(
                f,
                "open loop: {} connections, offered {r:.0} req/s for {:.1}s; latency from intended send time",
                self.connections, self.duration_s
            )?,
            None => writeln!(
                f,
                "closed loop: {} connections, fixed requests in flight, {:.1}s; latency is service time, not latency at a load",
                self.connections, self.duration_s
            )?,
        }
        writeln!(
            f,
            "achieved {:.0} req/s: {} sent, {} answered, {} lost",
            self.achieved_rate, self.sent, self.received, self.lost
        )?;
        let l = &self.latency;
        writeln!(
            f,
            "latency µs: p50 {}  p90 {}  p99 {}  p99.9 {}  p99.99 {}  max {}  mean {:.1}",
            l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.p9999_us, l.max_us, l.mean_us
        )?;
        let join = |m: &BTreeMap<String, u64>| m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        writeln!(f, "status: {}", join(&self.by_status))?;
        writeln!(f, "tier: {}", join(&self.by_tier))?;
        if self.late_sends > 0 {
            writeln!(
                f,
                "warning: the generator sent {} requests more than 1 ms late: it is saturated, the offered rate was not held",
                self.late_sends
            )?;
        }
        for e in &self.connection_errors {
            writeln!(f, "connection error: {e}")?;
        }
        Ok(())
    }
}

/// Parses durations like `500ms`, `5s`, `2m`, `250us`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration like 5s or 500ms"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1e3,
        "us" | "µs" => n / 1e6,
        "m" => n * 60.0,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (us, ms, s, m)")),
    };
    if !secs.is_finite() || !(0.0..=86_400.0).contains(&secs) {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("10us").unwrap(), Duration::from_micros(10));
        assert!(parse_duration("5h").is_err());
        assert!(parse_duration("fast").is_err());
    }
}
