//! Admission control: per-client token buckets, one set per shard.
//!
//! A request from a client over its rate gets `RateLimited` at once, before
//! any lookup or scoring. Buckets are shard-local (no sharing, no locks on
//! the request path). A configured client's rate holds for the client as a
//! whole, however its connections spread over the shards: every few
//! milliseconds, off the request path, each shard publishes how many
//! requests named each configured client ([`ClientUsage`], one counter per
//! shard and client, each written by its shard alone), reads the others',
//! and sets its bucket to the client's rate times its share of the client's
//! recent demand. The default limit of unconfigured clients (one bucket per
//! source address) is shared the same way, by the demand of the source's
//! slot among `SOURCE_SLOTS` (sources that hash to one slot pool their
//! demand, so their shares are approximate). The table holds at most
//! `clients_max` buckets; clients beyond that share one overflow bucket
//! with the default rate, so memory stays bounded whatever ids clients send.
//!
//! `client_id` is a field the client fills in, so it is trusted only as far
//! as the connection's source allows: a configured client may be bound to
//! source networks (`from`), and a request naming it from elsewhere is
//! refused (or treated as unknown, `on_mismatch = "default"`). Ids that are
//! not configured get no bucket of their own: they share their source
//! address's, so one source cannot fill the table by sending many ids.
//! A source's bucket that has refilled to its burst is the same as a new
//! one, so such idle buckets are dropped once a second (off the request
//! path): the table holds the sources active now, not every source seen
//! since start.
//!
//! A source network says little where callers share NAT or a mesh; with
//! mutual TLS on the scoring port, a configured client may instead (or
//! also) be bound to names its certificate presents (`tls_names`, matched
//! against the DNS and URI subject alternative names the client CA vouched
//! for), so another caller cannot spend its rate or its priority.
//!
//! `priority` is also the client's word, so it is capped: by the
//! configured client's `priority_max`, or for every other request by
//! `unknown_priority_max`; a request asking for more is shed as if it had
//! asked for the cap.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

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
    /// The highest `priority` this client's requests are shed as; higher
    /// ones are lowered to it.
    #[serde(default = "priority_max_any")]
    pub priority_max: u8,
    /// Names (DNS or URI subject alternative names) one of which the
    /// connection's client certificate must present; empty: any connection.
    /// Needs `[tls] client_ca_file`.
    #[serde(default)]
    pub tls_names: Vec<String>,
}

/// Who sent a request: the connection's peer address and the names its
/// verified client certificate presents (none without mutual TLS).
#[derive(Clone, Copy, Debug)]
pub struct Peer<'a> {
    pub addr: IpAddr,
    pub tls_names: &'a [String],
}

impl Peer<'_> {
    /// A peer with no certificate.
    pub fn at(addr: IpAddr) -> Peer<'static> {
        Peer { addr, tls_names: &[] }
    }
}

fn priority_max_any() -> u8 {
    u8::MAX
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
    /// The highest `priority` a request naming no configured client (or a
    /// bound one from elsewhere, with `on_mismatch = "default"`) is shed as.
    pub unknown_priority_max: u8,
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
    pub priority_max: u8,
    /// Empty: any connection.
    pub tls_names: Vec<String>,
}

impl Client {
    /// Whether a request naming this client may come from `peer`.
    fn binds(&self, peer: Peer<'_>) -> bool {
        (self.from.is_empty() || self.from.iter().any(|n| n.contains(peer.addr)))
            && (self.tls_names.is_empty() || self.tls_names.iter().any(|n| peer.tls_names.contains(n)))
    }
}

/// Most source buckets per shard (and clients configured): each shard's
/// table grows to `clients_max` under a spread of sources.
pub const CLIENTS_MAX: usize = 1 << 20;

impl AdmissionConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.clients_max > CLIENTS_MAX {
            return Err(format!("admission.clients_max = {} is outside 0..={CLIENTS_MAX}", self.clients_max));
        }
        Ok(())
    }

    /// The configured clients by numeric id; an id that is not a u32, a
    /// limit that is not positive or a network that does not parse is an
    /// error.
    pub fn client_limits(&self) -> Result<HashMap<u32, Client>, String> {
        if self.clients.len() > self.clients_max {
            return Err(format!(
                "admission.clients: {} clients configured, more than clients_max = {}",
                self.clients.len(),
                self.clients_max
            ));
        }
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
                if v.tls_names.iter().any(|n| n.is_empty() || n.len() > TLS_NAME_BYTES_MAX) {
                    return Err(format!("admission.clients.{k}.tls_names: names are 1 to {TLS_NAME_BYTES_MAX} bytes"));
                }
                Ok((id, Client { limit, from, priority_max: v.priority_max, tls_names: v.tls_names.clone() }))
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
        AdmissionConfig {
            default: None,
            clients: HashMap::new(),
            clients_max: 4096,
            on_mismatch: OnMismatch::Reject,
            unknown_priority_max: u8::MAX,
        }
    }
}

/// A token bucket: `burst` tokens, refilled at a rate. Also the shards'
/// handshake budget (`shard::tls`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bucket {
    tokens: f64,
    last_ns: u64,
    rate_per_ns: f64,
    burst: f64,
}

impl Bucket {
    /// A bucket for `share` (0..=1) of `limit`.
    pub(crate) fn new(limit: ClientLimit, share: f64, now_ns: u64) -> Bucket {
        let burst = (limit.burst * share).max(1.0);
        Bucket { tokens: burst, last_ns: now_ns, rate_per_ns: limit.rate_per_s * share / 1e9, burst }
    }

    /// Serves `share` of `limit` from now on, keeping what it holds up to
    /// the new burst.
    fn reshare(&mut self, limit: ClientLimit, share: f64) {
        self.burst = (limit.burst * share).max(1.0);
        self.rate_per_ns = limit.rate_per_s * share / 1e9;
        self.tokens = self.tokens.min(self.burst);
    }

    /// Whether it has refilled to its burst by `now_ns`: then it is the
    /// same as a new bucket and may be dropped.
    fn is_full_at(&self, now_ns: u64) -> bool {
        self.tokens + now_ns.saturating_sub(self.last_ns) as f64 * self.rate_per_ns >= self.burst
    }

    pub(crate) fn take(&mut self, now_ns: u64) -> bool {
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

/// What admission says of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Within its rate; its `priority` is shed as at most `priority_max`.
    Admitted { priority_max: u8 },
    /// Over its rate.
    OverRate,
    /// It named a client bound to other source networks, or certificate
    /// names, than its connection's.
    WrongSource,
}

/// Smoothing of each shard's demand per exchange (an exponential moving
/// average): at the watcher's 5 ms tick, demand that moved to another shard
/// is followed within a few tens of milliseconds.
const DEMAND_SMOOTHING: f64 = 0.2;
/// Demand (requests/s) counted for every shard on top of its own: an idle
/// client splits evenly, and a shard that starts seeing a client starts
/// from a share above zero.
const DEMAND_FLOOR_PER_S: f64 = 1.0;
/// Longest name a client may be bound to (a DNS name is at most 253).
const TLS_NAME_BYTES_MAX: usize = 1024;
/// How often idle source buckets are dropped.
const EVICT_EVERY_NS: u64 = 1_000_000_000;

/// Slots the sources of unconfigured clients hash into for the exchange:
/// the table traded stays bounded whatever addresses connect.
pub const SOURCE_SLOTS: usize = 256;

/// The slot of `source` (the same on every shard).
fn source_slot(source: IpAddr) -> usize {
    let bits = match source {
        IpAddr::V4(v4) => u64::from(u32::from(v4)),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => u64::from(u32::from(v4)),
            None => {
                let x = u128::from(v6);
                (x as u64) ^ ((x >> 64) as u64)
            }
        },
    };
    // Fibonacci hashing: the top bits of the product are well mixed.
    (bits.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % SOURCE_SLOTS
}

/// The one cross-thread part of admission: for each shard and column (a
/// configured client, or a slot of unconfigured clients' sources), how many
/// requests it got on that shard, published by the shard at each exchange
/// (a plain store: each counter has one writer).
#[derive(Debug)]
pub struct ClientUsage {
    shards: usize,
    /// Configured client ids, sorted: the column of each. The source slots
    /// follow them, when a default limit is set.
    ids: Vec<u32>,
    columns: usize,
    /// `counts[shard * columns + column]`.
    counts: Box<[AtomicU64]>,
    next_row: AtomicUsize,
}

impl ClientUsage {
    /// `config` must have passed `client_limits` (the config loader checks it).
    pub fn new(config: &AdmissionConfig, shards: usize) -> ClientUsage {
        let mut ids: Vec<u32> =
            config.client_limits().expect("admission config was validated at load").into_keys().collect();
        ids.sort_unstable();
        let shards = shards.max(1);
        let columns = ids.len() + if config.default.is_some() { SOURCE_SLOTS } else { 0 };
        ClientUsage {
            shards,
            counts: (0..shards * columns).map(|_| AtomicU64::new(0)).collect(),
            ids,
            columns,
            next_row: AtomicUsize::new(0),
        }
    }

    /// A row of counters for one shard; `None` once every shard has one
    /// (only tests build more request paths than shards: those split rates
    /// evenly instead).
    fn join(&self) -> Option<usize> {
        let row = self.next_row.fetch_add(1, Ordering::Relaxed);
        (row < self.shards).then_some(row)
    }
}

/// How a shard takes part in the exchange of configured clients' demand.
struct Exchange {
    usage: Arc<ClientUsage>,
    /// This shard's row.
    row: usize,
    /// Requests each column got here, since start.
    demand: Vec<u64>,
    /// `[shard * columns + column]`: each counter as last read, and the
    /// smoothed demand it showed, in requests/s.
    seen: Vec<u64>,
    smoothed: Vec<f64>,
    last_ns: Option<u64>,
}

/// One shard's buckets.
pub struct Admission {
    config: AdmissionConfig,
    /// Configured clients, with their column in the usage table.
    clients: HashMap<u32, (Client, usize)>,
    shards: usize,
    /// This shard's share of each column's rate.
    share: Vec<f64>,
    exchange: Option<Exchange>,
    /// Each configured client's bucket, by column, made at its first
    /// request: a configured client always has its own.
    client_buckets: Vec<Option<Bucket>>,
    /// Requests naming no configured client share their source's bucket:
    /// at most `clients_max` of them.
    buckets: HashMap<IpAddr, Bucket>,
    overflow: Option<Bucket>,
    last_eviction_ns: u64,
}

impl Admission {
    /// `config` must have passed `client_limits` (the config loader checks
    /// it), and `usage` be built from it for `shards` shards.
    pub fn new(config: AdmissionConfig, shards: usize, usage: Arc<ClientUsage>) -> Admission {
        let shards = shards.max(1);
        let limits = config.client_limits().expect("admission config was validated at load");
        assert_eq!(limits.len(), usage.ids.len(), "the usage table is the config's");
        let clients: HashMap<u32, (Client, usize)> = limits
            .into_iter()
            .map(|(id, c)| {
                let column = usage.ids.binary_search(&id).expect("the usage table is the config's");
                (id, (c, column))
            })
            .collect();
        let columns = usage.columns;
        let exchange = usage.join().map(|row| Exchange {
            row,
            demand: vec![0; columns],
            seen: vec![0; usage.shards * columns],
            smoothed: vec![0.0; usage.shards * columns],
            last_ns: None,
            usage: usage.clone(),
        });
        let capacity = config.clients_max.min(64);
        Admission {
            config,
            clients,
            shards,
            share: vec![1.0 / shards as f64; columns],
            exchange,
            client_buckets: vec![None; usage.ids.len()],
            buckets: HashMap::with_capacity(capacity),
            overflow: None,
            last_eviction_ns: 0,
        }
    }

    /// Publishes this shard's demand for each configured client and source
    /// slot, reads the other shards', and sets each bucket to this shard's
    /// share of its column's recent demand. Off the request path: the
    /// shard's watcher calls it every few milliseconds. O(shards × (clients
    /// + SOURCE_SLOTS) + source buckets).
    pub fn exchange(&mut self, now_ns: u64) {
        if now_ns.saturating_sub(self.last_eviction_ns) >= EVICT_EVERY_NS {
            self.last_eviction_ns = now_ns;
            self.evict_idle(now_ns);
        }
        let Some(x) = &mut self.exchange else {
            return;
        };
        let columns = x.demand.len();
        for (col, &d) in x.demand.iter().enumerate() {
            x.usage.counts[x.row * columns + col].store(d, Ordering::Relaxed);
        }
        let Some(last_ns) = x.last_ns.replace(now_ns) else {
            for (seen, count) in x.seen.iter_mut().zip(x.usage.counts.iter()) {
                *seen = count.load(Ordering::Relaxed);
            }
            return;
        };
        let dt_s = now_ns.saturating_sub(last_ns) as f64 / 1e9;
        if dt_s <= 0.0 {
            return;
        }
        let shards = x.usage.shards;
        for col in 0..columns {
            let mut total = 0.0;
            for s in 0..shards {
                let k = s * columns + col;
                let count = x.usage.counts[k].load(Ordering::Relaxed);
                let rate = count.saturating_sub(x.seen[k]) as f64 / dt_s;
                x.seen[k] = count;
                x.smoothed[k] += DEMAND_SMOOTHING * (rate - x.smoothed[k]);
                total += x.smoothed[k];
            }
            let mine = x.smoothed[x.row * columns + col];
            self.share[col] = (mine + DEMAND_FLOOR_PER_S) / (total + shards as f64 * DEMAND_FLOOR_PER_S);
        }
        for (col, &id) in x.usage.ids.iter().enumerate() {
            if let Some(b) = &mut self.client_buckets[col] {
                b.reshare(self.clients[&id].0.limit, self.share[col]);
            }
        }
        if let Some(limit) = self.config.default {
            let first_slot = x.usage.ids.len();
            for (&source, b) in self.buckets.iter_mut() {
                b.reshare(limit, self.share[first_slot + source_slot(source)]);
            }
        }
    }

    /// Drops the source buckets that have refilled to their burst (idle
    /// long enough to be the same as new ones), so sources seen once do not
    /// push new ones into the overflow bucket for the life of the process.
    /// O(buckets), off the request path.
    pub fn evict_idle(&mut self, now_ns: u64) {
        self.buckets.retain(|_, b| !b.is_full_at(now_ns));
    }

    /// Source buckets held now.
    pub fn source_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Whether a request naming `client_id`, on a connection from `source`
    /// without a client certificate, may proceed at `now_ns`.
    pub fn admit(&mut self, client_id: u32, source: IpAddr, now_ns: u64) -> Admit {
        self.admit_from(client_id, Peer::at(source), now_ns)
    }

    /// Whether a request naming `client_id`, from `peer`, may proceed at
    /// `now_ns`.
    pub fn admit_from(&mut self, client_id: u32, peer: Peer<'_>, now_ns: u64) -> Admit {
        let source = peer.addr;
        let configured = self.clients.get(&client_id).map(|(c, column)| {
            if c.binds(peer) {
                Ok((c.limit, *column, c.priority_max))
            } else {
                Err(())
            }
        });
        let even = 1.0 / self.shards as f64;
        let mut priority_max = self.config.unknown_priority_max;
        let taken = match configured {
            Some(Ok((limit, column, client_priority_max))) => {
                priority_max = client_priority_max;
                if let Some(x) = &mut self.exchange {
                    x.demand[column] += 1;
                }
                let share = self.share[column];
                self.client_buckets[column].get_or_insert_with(|| Bucket::new(limit, share, now_ns)).take(now_ns)
            }
            Some(Err(())) if self.config.on_mismatch == OnMismatch::Reject => return Admit::WrongSource,
            _ => {
                let Some(limit) = self.config.default else {
                    return Admit::Admitted { priority_max };
                };
                let column = self.client_buckets.len() + source_slot(source);
                if let Some(x) = &mut self.exchange {
                    x.demand[column] += 1;
                }
                if let Some(b) = self.buckets.get_mut(&source) {
                    b.take(now_ns)
                } else if self.buckets.len() < self.config.clients_max {
                    let mut b = Bucket::new(limit, self.share[column], now_ns);
                    let ok = b.take(now_ns);
                    self.buckets.insert(source, b);
                    ok
                } else {
                    self.overflow.get_or_insert_with(|| Bucket::new(limit, even, now_ns)).take(now_ns)
                }
            }
        };
        if taken {
            Admit::Admitted { priority_max }
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
        clients.insert(
            "7".to_string(),
            ClientEntry { rate_per_s: 1_000.0, burst: 10.0, from: vec![], priority_max: 9, tls_names: vec![] },
        );
        clients.insert(
            "8".to_string(),
            ClientEntry {
                rate_per_s: 1_000.0,
                burst: 10.0,
                from: vec!["10.1.0.0/16".into(), "::1".into()],
                priority_max: u8::MAX,
                tls_names: vec![],
            },
        );
        AdmissionConfig {
            default: Some(ClientLimit { rate_per_s: 100.0, burst: 2.0 }),
            clients,
            clients_max: 3,
            on_mismatch: OnMismatch::Reject,
            unknown_priority_max: 3,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn admission(cfg: AdmissionConfig, shards: usize) -> Admission {
        let usage = Arc::new(ClientUsage::new(&cfg, shards));
        Admission::new(cfg, shards, usage)
    }

    /// `shards` shards sharing one usage table; each offers client 7
    /// `offered_per_s[shard]` requests/s (evenly spaced) for `seconds`, and
    /// exchanges every 5 ms. Returns what each admitted.
    fn run_shards(offered_per_s: &[f64], seconds: f64) -> Vec<u64> {
        run_shards_as(7, offered_per_s, seconds)
    }

    /// `run_shards` for requests naming `client_id` from 127.0.0.1.
    fn run_shards_as(client_id: u32, offered_per_s: &[f64], seconds: f64) -> Vec<u64> {
        let cfg = config();
        let usage = Arc::new(ClientUsage::new(&cfg, offered_per_s.len()));
        let mut shards: Vec<Admission> =
            offered_per_s.iter().map(|_| Admission::new(cfg.clone(), offered_per_s.len(), usage.clone())).collect();
        let mut admitted = vec![0u64; shards.len()];
        let mut next_ns: Vec<f64> = vec![0.0; shards.len()];
        let step_ns = 50_000u64;
        let end_ns = (seconds * 1e9) as u64;
        let mut t = 0;
        while t < end_ns {
            for (i, a) in shards.iter_mut().enumerate() {
                while offered_per_s[i] > 0.0 && next_ns[i] <= t as f64 {
                    admitted[i] += u64::from(matches!(a.admit(client_id, ip("127.0.0.1"), t), Admit::Admitted { .. }));
                    next_ns[i] += 1e9 / offered_per_s[i];
                }
                if t % 5_000_000 == 0 {
                    a.exchange(t);
                }
            }
            t += step_ns;
        }
        admitted
    }

    #[test]
    fn a_clients_rate_holds_across_shards_however_its_demand_spreads() {
        // Client 7: 1,000/s, burst 10. Two seconds, 4,000/s offered.
        let want = 2_000.0 + 10.0;
        for offered in [vec![4_000.0, 0.0], vec![2_000.0, 2_000.0], vec![3_500.0, 500.0], vec![1_000.0; 4]] {
            let admitted = run_shards(&offered, 2.0);
            let total: u64 = admitted.iter().sum();
            assert!((total as f64 - want).abs() <= 0.05 * want, "{offered:?}: {admitted:?} admitted");
        }
        // A client under its rate is never refused, whichever shard it uses.
        let admitted = run_shards(&[400.0, 200.0], 2.0);
        assert!(admitted[0] >= 799 && admitted[1] >= 399, "{admitted:?}");
    }

    #[test]
    fn an_unconfigured_sources_default_rate_holds_across_shards_too() {
        // The default: 100/s, burst 2. Client 99 is not configured.
        let want = 2.0 * 100.0 + 2.0;
        for offered in [vec![400.0, 0.0], vec![200.0, 200.0]] {
            let admitted = run_shards_as(99, &offered, 2.0);
            let total: u64 = admitted.iter().sum();
            assert!((total as f64 - want).abs() <= 0.05 * want, "{offered:?}: {admitted:?} admitted");
        }
        // Every source maps to one slot, the same on every shard.
        let slots: std::collections::HashSet<usize> =
            (0..=255u8).map(|i| source_slot(IpAddr::from([10, 0, 0, i]))).collect();
        assert!(slots.len() > 100, "{} distinct slots of 256 addresses", slots.len());
        assert_eq!(source_slot(ip("10.0.0.1")), source_slot(ip("::ffff:10.0.0.1")));
    }

    #[test]
    fn more_request_paths_than_shards_split_evenly() {
        let cfg = config();
        let usage = Arc::new(ClientUsage::new(&cfg, 1));
        let _first = Admission::new(cfg.clone(), 1, usage.clone());
        let mut second = Admission::new(cfg, 2, usage);
        assert!(second.exchange.is_none());
        second.exchange(5_000_000);
        assert_eq!((0..20).filter(|_| ok(second.admit(7, ip("127.0.0.1"), 0))).count(), 5, "half the burst");
    }

    #[test]
    fn more_configured_clients_than_buckets_is_refused() {
        let mut cfg = config();
        cfg.clients_max = 1;
        assert!(cfg.client_limits().unwrap_err().contains("more than clients_max = 1"));
    }

    fn ok(a: Admit) -> bool {
        matches!(a, Admit::Admitted { .. })
    }

    #[test]
    fn burst_then_rate() {
        let mut a = admission(config(), 1);
        let here = ip("127.0.0.1");
        let admitted = (0..20).filter(|_| ok(a.admit(7, here, 0))).count();
        assert_eq!(admitted, 10, "the burst");
        assert_eq!(a.admit(7, here, 500_000), Admit::OverRate, "half a token after 0.5 ms");
        assert!(ok(a.admit(7, here, 1_000_000)), "one token per ms at 1000/s");
        assert!(!ok(a.admit(7, here, 1_000_000)));
    }

    #[test]
    fn unknown_ids_share_their_sources_bucket_and_sources_share_overflow() {
        let mut a = admission(config(), 1);
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
        let mut a = admission(config(), 1);
        assert!(ok(a.admit(8, ip("10.1.200.3"), 0)));
        assert!(ok(a.admit(8, ip("::1"), 0)));
        assert!(ok(a.admit(8, ip("::ffff:10.1.0.9"), 0)), "a v4 client on a v6 socket");
        assert_eq!(a.admit(8, ip("10.2.0.1"), 0), Admit::WrongSource);
        assert_eq!(a.admit(8, ip("127.0.0.1"), 0), Admit::WrongSource);
        let mut cfg = config();
        cfg.on_mismatch = OnMismatch::Default;
        let mut a = admission(cfg, 1);
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
        let mut a = admission(cfg, 2);
        let here = ip("127.0.0.1");
        assert!((0..1000).all(|_| ok(a.admit(99, here, 0))));
        assert_eq!((0..20).filter(|_| ok(a.admit(7, here, 0))).count(), 5, "half the burst per shard");
    }

    #[test]
    fn priorities_are_capped_by_who_the_client_is() {
        let mut a = admission(config(), 1);
        assert_eq!(a.admit(7, ip("127.0.0.1"), 0), Admit::Admitted { priority_max: 9 });
        assert_eq!(a.admit(8, ip("10.1.2.3"), 0), Admit::Admitted { priority_max: u8::MAX });
        // An unknown id, and a bound id from elsewhere treated as unknown.
        assert_eq!(a.admit(99, ip("127.0.0.1"), 0), Admit::Admitted { priority_max: 3 });
        let mut lenient = config();
        lenient.on_mismatch = OnMismatch::Default;
        let mut a = admission(lenient, 1);
        assert_eq!(a.admit(8, ip("192.0.2.1"), 0), Admit::Admitted { priority_max: 3 });
        let parsed: AdmissionConfig = toml::from_str(
            "unknown_priority_max = 2\n[clients.5]\nrate_per_s = 1.0\nburst = 1.0\npriority_max = 7\n[clients.6]\nrate_per_s = 1.0\nburst = 1.0\n",
        )
        .unwrap();
        let limits = parsed.client_limits().unwrap();
        assert_eq!((limits[&5].priority_max, limits[&6].priority_max, parsed.unknown_priority_max), (7, 255, 2));
    }

    #[test]
    fn idle_sources_give_their_place_back_to_new_ones() {
        // clients_max = 3 source buckets; the default limit refills 2 tokens
        // at 100/s, so a source idle for 20 ms is as good as new.
        let mut a = admission(config(), 1);
        for last in 1..=3u8 {
            a.admit(99, IpAddr::from([192, 0, 2, last]), 0);
        }
        assert_eq!(a.source_buckets(), 3);
        // A fourth source now shares the overflow bucket (burst 2).
        let fourth = IpAddr::from([192, 0, 2, 4]);
        let admitted = (0..4).filter(|_| matches!(a.admit(99, fourth, 1_000), Admit::Admitted { .. })).count();
        assert_eq!(admitted, 2);
        // A busy source keeps its bucket; the idle ones are dropped.
        let busy = IpAddr::from([192, 0, 2, 1]);
        for _ in 0..5 {
            a.admit(99, busy, 30_000_000);
        }
        a.evict_idle(30_000_001);
        assert_eq!(a.source_buckets(), 1, "only the busy source keeps its bucket");
        // The fourth source gets a bucket of its own and its full burst.
        let admitted = (0..4).filter(|_| matches!(a.admit(99, fourth, 30_000_002), Admit::Admitted { .. })).count();
        assert_eq!(admitted, 2);
        assert_eq!(a.source_buckets(), 2);
        // The watcher's exchange drops them once a second.
        a.exchange(2_000_000_000);
        assert_eq!(a.source_buckets(), 0);
    }

    #[test]
    fn a_client_bound_to_certificate_names_is_admitted_only_with_one() {
        let mut cfg = config();
        cfg.clients.get_mut("7").unwrap().tls_names = vec!["bidder-eu.internal".into(), "spiffe://ads/bidder".into()];
        let mut a = admission(cfg.clone(), 1);
        let here = ip("10.9.0.1");
        let eu = ["other.internal".to_string(), "bidder-eu.internal".to_string()];
        assert_eq!(a.admit_from(7, Peer { addr: here, tls_names: &eu }, 0), Admit::Admitted { priority_max: 9 });
        let spiffe = ["spiffe://ads/bidder".to_string()];
        assert!(matches!(a.admit_from(7, Peer { addr: here, tls_names: &spiffe }, 0), Admit::Admitted { .. }));
        let stranger = ["bidder-us.internal".to_string()];
        assert_eq!(a.admit_from(7, Peer { addr: here, tls_names: &stranger }, 0), Admit::WrongSource);
        assert_eq!(a.admit(7, here, 0), Admit::WrongSource, "no certificate, no claim to the id");
        // Treated as unknown instead, it gets the unknown ceiling.
        cfg.on_mismatch = OnMismatch::Default;
        let mut lenient = admission(cfg.clone(), 1);
        assert_eq!(lenient.admit(7, here, 0), Admit::Admitted { priority_max: 3 });
        cfg.clients.get_mut("7").unwrap().tls_names = vec![String::new()];
        assert!(cfg.client_limits().unwrap_err().contains("tls_names"));
    }
}
