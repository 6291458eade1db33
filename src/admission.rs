//! Admission control: per-client token buckets, one set per shard.
//!
//! A request from a client over its rate gets `RateLimited` at once, before
//! any lookup or scoring. Buckets are shard-local (no sharing, no locks); a
//! client's configured rate is split evenly over the shards, since its
//! connections spread over them by SO_REUSEPORT hashing. The table holds at
//! most `clients_max` buckets; clients beyond that share one overflow bucket
//! with the default rate, so memory stays bounded whatever ids clients send.
//!
//! `client_id` is a field the client fills in, so it is trusted only as far
//! as the connection's source allows: a configured client may be bound to
//! source networks (`from`), and a request naming it from elsewhere is
//! refused (or treated as unknown, `on_mismatch = "default"`). Ids that are
//! not configured get no bucket of their own: they share their source
//! address's, so one source cannot fill the table by sending many ids.

use std::collections::HashMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// Rate and burst for one client, in requests.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientLimit {
    pub rate_per_s: f64,
    pub burst: f64,
}

/// A configured client: its limit and, optionally, the source networks its
/// connections must come from.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientEntry {
    pub rate_per_s: f64,
    pub burst: f64,
    /// CIDR networks (`"10.1.0.0/16"`, `"::1/128"`) or single addresses;
    /// empty: any source may use this id.
    #[serde(default)]
    pub from: Vec<String>,
}

/// What a request naming a bound client from another source gets.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnMismatch {
    /// `RateLimited`, saying why.
    #[default]
    Reject,
    /// Admitted as an unknown client of its source (the default limit).
    Default,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Limit for clients not listed in `clients` (per source address);
    /// `None` admits them all.
    pub default: Option<ClientLimit>,
    /// Limits by `client_id` (TOML keys are strings: `[admission.clients.7]`).
    pub clients: HashMap<String, ClientEntry>,
    /// Buckets kept per shard.
    pub clients_max: usize,
    pub on_mismatch: OnMismatch,
}

/// A source network: an address and a prefix length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Net {
    addr: IpAddr,
    prefix: u8,
}

impl Net {
    /// `"10.1.0.0/16"`, `"fe80::/10"`, or an address alone (all its bits).
    pub fn parse(s: &str) -> Result<Net, String> {
        let (a, p) = s.split_once('/').map_or((s, None), |(a, p)| (a, Some(p)));
        let addr: IpAddr = a.trim().parse().map_err(|_| format!("'{s}' is not an address or CIDR network"))?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => bits,
            Some(p) => match p.trim().parse::<u8>() {
                Ok(n) if n <= bits => n,
                _ => return Err(format!("'{s}': the prefix length must be 0 to {bits}")),
            },
        };
        Ok(Net { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        // A v4 client on a dual-stack socket shows as ::ffff:a.b.c.d.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let (a, b, bits) = match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(x)) => (u128::from(u32::from(n)), u128::from(u32::from(x)), 32),
            (IpAddr::V6(n), IpAddr::V6(x)) => (u128::from(n), u128::from(x), 128),
            _ => return false,
        };
        let shift = bits - u32::from(self.prefix);
        shift >= bits || (a >> shift) == (b >> shift)
    }
}

/// A configured client, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Client {
    pub limit: ClientLimit,
    /// Empty: any source.
    pub from: Vec<Net>,
}

impl AdmissionConfig {
    /// The configured clients by numeric id; an id that is not a u32, a
    /// limit that is not positive or a network that does not parse is an
    /// error.
    pub fn client_limits(&self) -> Result<HashMap<u32, Client>, String> {
        self.clients
            .iter()
            .map(|(k, v)| {
                let id = k.parse::<u32>().map_err(|_| format!("admission.clients.{k}: not a client id (u32)"))?;
                let limit = ClientLimit { rate_per_s: v.rate_per_s, burst: v.burst };
                limit.check().map_err(|e| format!("admission.clients.{k}: {e}"))?;
                let from = v
                    .from
                    .iter()
                    .map(|n| Net::parse(n))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("admission.clients.{k}.from: {e}"))?;
                Ok((id, Client { limit, from }))
            })
            .collect()
    }
}

impl ClientLimit {
    fn check(&self) -> Result<(), String> {
        if !(self.rate_per_s > 0.0 && self.rate_per_s.is_finite() && self.burst >= 1.0 && self.burst.is_finite()) {
            return Err("rate_per_s must be > 0 and burst >= 1".into());
        }
        Ok(())
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig { default: None, clients: HashMap::new(), clients_max: 4096, on_mismatch: OnMismatch::Reject }
    }
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    last_ns: u64,
    rate_per_ns: f64,
    burst: f64,
}

impl Bucket {
    fn new(limit: ClientLimit, shards: usize, now_ns: u64) -> Bucket {
        let burst = (limit.burst / shards as f64).max(1.0);
        Bucket { tokens: burst, last_ns: now_ns, rate_per_ns: limit.rate_per_s / shards as f64 / 1e9, burst }
    }

    fn take(&mut self, now_ns: u64) -> bool {
        let elapsed_ns = now_ns.saturating_sub(self.last_ns);
        self.last_ns = now_ns;
        self.tokens = (self.tokens + elapsed_ns as f64 * self.rate_per_ns).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Whose bucket a request spends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Client(u32),
    /// Requests naming no configured client share their source's bucket.
    Source(IpAddr),
}

/// What admission says of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    Admitted,
    /// Over its rate.
    OverRate,
    /// It named a client bound to other source networks than its own.
    WrongSource,
}

/// One shard's buckets.
pub struct Admission {
    config: AdmissionConfig,
    clients: HashMap<u32, Client>,
    shards: usize,
    buckets: HashMap<Key, Bucket>,
    overflow: Option<Bucket>,
}

impl Admission {
    /// `config` must have passed `client_limits` (the config loader checks it).
    pub fn new(config: AdmissionConfig, shards: usize) -> Admission {
        let clients = config.client_limits().expect("admission config was validated at load");
        let capacity = config.clients_max.min(clients.len() + 64);
        Admission { config, clients, shards: shards.max(1), buckets: HashMap::with_capacity(capacity), overflow: None }
    }

    /// Whether a request naming `client_id`, on a connection from `source`,
    /// may proceed at `now_ns`.
    pub fn admit(&mut self, client_id: u32, source: IpAddr, now_ns: u64) -> Admit {
        let configured = self.clients.get(&client_id).map(|c| {
            if c.from.is_empty() || c.from.iter().any(|n| n.contains(source)) {
                Ok(c.limit)
            } else {
                Err(())
            }
        });
        let (key, limit) = match configured {
            Some(Ok(limit)) => (Key::Client(client_id), limit),
            Some(Err(())) if self.config.on_mismatch == OnMismatch::Reject => return Admit::WrongSource,
            _ => match self.config.default {
                Some(l) => (Key::Source(source), l),
                None => return Admit::Admitted,
            },
        };
        let taken = if let Some(b) = self.buckets.get_mut(&key) {
            b.take(now_ns)
        } else if self.buckets.len() < self.config.clients_max {
            let mut b = Bucket::new(limit, self.shards, now_ns);
            let ok = b.take(now_ns);
            self.buckets.insert(key, b);
            ok
        } else {
            let shards = self.shards;
            let default = self.config.default.unwrap_or(limit);
            self.overflow.get_or_insert_with(|| Bucket::new(default, shards, now_ns)).take(now_ns)
        };
        if taken {
            Admit::Admitted
        } else {
            Admit::OverRate
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AdmissionConfig {
        let mut clients = HashMap::new();
        clients.insert("7".to_string(), ClientEntry { rate_per_s: 1_000.0, burst: 10.0, from: vec![] });
        clients.insert(
            "8".to_string(),
            ClientEntry { rate_per_s: 1_000.0, burst: 10.0, from: vec!["10.1.0.0/16".into(), "::1".into()] },
        );
        AdmissionConfig {
            default: Some(ClientLimit { rate_per_s: 100.0, burst: 2.0 }),
            clients,
            clients_max: 3,
            on_mismatch: OnMismatch::Reject,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn ok(a: Admit) -> bool {
        a == Admit::Admitted
    }

    #[test]
    fn burst_then_rate() {
        let mut a = Admission::new(config(), 1);
        let here = ip("127.0.0.1");
        let admitted = (0..20).filter(|_| ok(a.admit(7, here, 0))).count();
        assert_eq!(admitted, 10, "the burst");
        assert_eq!(a.admit(7, here, 500_000), Admit::OverRate, "half a token after 0.5 ms");
        assert!(ok(a.admit(7, here, 1_000_000)), "one token per ms at 1000/s");
        assert!(!ok(a.admit(7, here, 1_000_000)));
    }

    #[test]
    fn unknown_ids_share_their_sources_bucket_and_sources_share_overflow() {
        let mut a = Admission::new(config(), 1);
        let one = ip("192.0.2.1");
        // Ids 1, 2, 3 from one source: one bucket of burst 2.
        assert!(ok(a.admit(1, one, 0)) && ok(a.admit(2, one, 0)) && !ok(a.admit(3, one, 0)));
        assert!(ok(a.admit(1, ip("192.0.2.2"), 0)));
        assert!(ok(a.admit(1, ip("192.0.2.3"), 0)));
        assert_eq!(a.buckets.len(), 3);
        // The table is full: more sources share one overflow bucket.
        assert!(ok(a.admit(1, ip("192.0.2.4"), 0)) && ok(a.admit(1, ip("192.0.2.5"), 0)));
        assert!(!ok(a.admit(1, ip("192.0.2.6"), 0)));
        assert_eq!(a.buckets.len(), 3);
    }

    #[test]
    fn a_bound_client_is_admitted_only_from_its_networks() {
        let mut a = Admission::new(config(), 1);
        assert!(ok(a.admit(8, ip("10.1.200.3"), 0)));
        assert!(ok(a.admit(8, ip("::1"), 0)));
        assert!(ok(a.admit(8, ip("::ffff:10.1.0.9"), 0)), "a v4 client on a v6 socket");
        assert_eq!(a.admit(8, ip("10.2.0.1"), 0), Admit::WrongSource);
        assert_eq!(a.admit(8, ip("127.0.0.1"), 0), Admit::WrongSource);
        let mut cfg = config();
        cfg.on_mismatch = OnMismatch::Default;
        let mut a = Admission::new(cfg, 1);
        let there = ip("10.2.0.1");
        // Treated as an unknown client of its source: the default burst of 2.
        assert!(ok(a.admit(8, there, 0)) && ok(a.admit(8, there, 0)));
        assert_eq!(a.admit(8, there, 0), Admit::OverRate);
    }

    #[test]
    fn networks_parse_and_match() {
        assert!(Net::parse("10.0.0.0/8").unwrap().contains(ip("10.255.1.1")));
        assert!(!Net::parse("10.0.0.0/8").unwrap().contains(ip("11.0.0.1")));
        assert!(Net::parse("0.0.0.0/0").unwrap().contains(ip("203.0.113.9")));
        assert!(Net::parse("fe80::/10").unwrap().contains(ip("fe80::1")));
        assert!(!Net::parse("fe80::/10").unwrap().contains(ip("10.0.0.1")));
        assert!(Net::parse("192.0.2.7").unwrap().contains(ip("192.0.2.7")));
        assert!(!Net::parse("192.0.2.7").unwrap().contains(ip("192.0.2.8")));
        assert!(Net::parse("10.0.0.0/33").unwrap_err().contains("0 to 32"));
        assert!(Net::parse("ten").is_err());
        let mut cfg = config();
        cfg.clients.get_mut("8").unwrap().from.push("10.0.0.0/99".into());
        assert!(cfg.client_limits().unwrap_err().contains("admission.clients.8.from"));
    }

    #[test]
    fn no_default_admits_everyone_else_and_shards_split_the_rate() {
        let mut cfg = config();
        cfg.default = None;
        let mut a = Admission::new(cfg, 2);
        let here = ip("127.0.0.1");
        assert!((0..1000).all(|_| ok(a.admit(99, here, 0))));
        assert_eq!((0..20).filter(|_| ok(a.admit(7, here, 0))).count(), 5, "half the burst per shard");
    }
}
