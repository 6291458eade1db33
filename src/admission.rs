//! Admission control: per-client token buckets, one set per shard.
//!
//! A request from a client over its rate gets `RateLimited` at once, before
//! any lookup or scoring. Buckets are shard-local (no sharing, no locks); a
//! client's configured rate is split evenly over the shards, since its
//! connections spread over them by SO_REUSEPORT hashing. The table holds at
//! most `clients_max` buckets; clients beyond that share one overflow bucket
//! with the default rate, so memory stays bounded whatever ids clients send.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Rate and burst for one client, in requests.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientLimit {
    pub rate_per_s: f64,
    pub burst: f64,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Limit for clients not listed in `clients`; `None` admits them all.
    pub default: Option<ClientLimit>,
    /// Limits by `client_id` (TOML keys are strings: `[admission.clients.7]`).
    pub clients: HashMap<String, ClientLimit>,
    /// Buckets kept per shard.
    pub clients_max: usize,
}

impl AdmissionConfig {
    /// The per-client limits by numeric id; an id that is not a u32 or a
    /// limit that is not positive is an error.
    pub fn client_limits(&self) -> Result<HashMap<u32, ClientLimit>, String> {
        self.clients
            .iter()
            .map(|(k, v)| {
                let id = k.parse::<u32>().map_err(|_| format!("admission.clients.{k}: not a client id (u32)"))?;
                v.check().map_err(|e| format!("admission.clients.{k}: {e}"))?;
                Ok((id, *v))
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
        AdmissionConfig { default: None, clients: HashMap::new(), clients_max: 4096 }
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

/// One shard's buckets.
pub struct Admission {
    config: AdmissionConfig,
    limits: HashMap<u32, ClientLimit>,
    shards: usize,
    buckets: HashMap<u32, Bucket>,
    overflow: Option<Bucket>,
}

impl Admission {
    /// `config` must have passed `client_limits` (the config loader checks it).
    pub fn new(config: AdmissionConfig, shards: usize) -> Admission {
        let limits = config.client_limits().expect("admission config was validated at load");
        let capacity = config.clients_max.min(limits.len() + 64);
        Admission { config, limits, shards: shards.max(1), buckets: HashMap::with_capacity(capacity), overflow: None }
    }

    /// Whether a request from `client_id` may proceed at `now_ns`.
    pub fn admit(&mut self, client_id: u32, now_ns: u64) -> bool {
        let limit = match self.limits.get(&client_id) {
            Some(l) => *l,
            None => match self.config.default {
                Some(l) => l,
                None => return true,
            },
        };
        if let Some(b) = self.buckets.get_mut(&client_id) {
            return b.take(now_ns);
        }
        if self.buckets.len() < self.config.clients_max {
            let mut b = Bucket::new(limit, self.shards, now_ns);
            let ok = b.take(now_ns);
            self.buckets.insert(client_id, b);
            return ok;
        }
        let shards = self.shards;
        let default = self.config.default.unwrap_or(limit);
        self.overflow.get_or_insert_with(|| Bucket::new(default, shards, now_ns)).take(now_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AdmissionConfig {
        let mut clients = HashMap::new();
        clients.insert("7".to_string(), ClientLimit { rate_per_s: 1_000.0, burst: 10.0 });
        AdmissionConfig { default: Some(ClientLimit { rate_per_s: 100.0, burst: 2.0 }), clients, clients_max: 3 }
    }

    #[test]
    fn burst_then_rate() {
        let mut a = Admission::new(config(), 1);
        let admitted = (0..20).filter(|_| a.admit(7, 0)).count();
        assert_eq!(admitted, 10, "the burst");
        assert!(!a.admit(7, 500_000), "half a token after 0.5 ms");
        assert!(a.admit(7, 1_000_000), "one token per ms at 1000/s");
        assert!(!a.admit(7, 1_000_000));
    }

    #[test]
    fn unknown_clients_get_the_default_and_share_overflow() {
        let mut a = Admission::new(config(), 1);
        assert!(a.admit(1, 0) && a.admit(1, 0) && !a.admit(1, 0));
        assert!(a.admit(2, 0) && a.admit(2, 0) && !a.admit(2, 0));
        assert!(a.admit(3, 0));
        // The table is full (3 buckets): more ids share one overflow bucket.
        assert!(a.admit(4, 0) && a.admit(5, 0) && !a.admit(6, 0));
        assert_eq!(a.buckets.len(), 3);
    }

    #[test]
    fn no_default_admits_everyone_else_and_shards_split_the_rate() {
        let mut cfg = config();
        cfg.default = None;
        let mut a = Admission::new(cfg, 2);
        assert!((0..1000).all(|_| a.admit(99, 0)));
        assert_eq!((0..20).filter(|_| a.admit(7, 0)).count(), 5, "half the burst per shard");
    }
}
