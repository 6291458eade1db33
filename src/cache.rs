//! The score cache: one per shard, a rung of the degradation ladder.
//!
//! Key: (model name, model version, user id, item id, context hash); value:
//! the score and when it expires. The version is part of the key, so a new
//! version never serves an old version's scores.
//!
//! A fixed-size, 4-way set-associative table allocated at start-up: a key
//! hashes to one set of four entries; a miss that must insert replaces an
//! expired entry, else the one that expires first. Memory is bounded and
//! known (`entries_max` × 40 bytes), lookups touch one or two cache lines and
//! never allocate, and with one TTL for all entries "expires first" is
//! "inserted first" within the set: FIFO per set, which is close to LRU for
//! the short TTLs a scoring cache uses.

use serde::{Deserialize, Serialize};

const WAYS: usize = 4;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Entries per shard, rounded up to a multiple of 4; 0 disables the cache.
    pub entries_max: usize,
    pub ttl_ms: u64,
    /// Answer from the cache before the primary when every candidate is
    /// cached (re-ranking workloads whose candidate sets barely change).
    pub before_primary: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig { entries_max: 65_536, ttl_ms: 60_000, before_primary: false }
    }
}

/// What identifies a cached score.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Key {
    pub model: u64,
    pub version: u32,
    pub user: u64,
    pub item: u64,
    pub context: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    key: Key,
    score: f32,
    /// 0 marks an empty entry.
    expires_ns: u64,
}

/// A 64-bit mix (SplitMix64's finaliser).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes a model name or the bits of a context vector into a key field.
pub fn hash_words(words: impl IntoIterator<Item = u64>) -> u64 {
    words.into_iter().fold(0x5155_4956_4552, |h, w| mix(h ^ w))
}

pub struct ScoreCache {
    entries: Vec<Entry>,
    sets: usize,
    ttl_ns: u64,
    pub hits: u64,
    pub misses: u64,
}

impl ScoreCache {
    pub fn new(config: &CacheConfig) -> ScoreCache {
        let sets = config.entries_max.div_ceil(WAYS);
        ScoreCache {
            entries: vec![Entry::default(); sets * WAYS],
            sets,
            ttl_ns: config.ttl_ms * 1_000_000,
            hits: 0,
            misses: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.sets > 0
    }

    fn set_of(&self, k: &Key) -> usize {
        let h = mix(k.model ^ mix(u64::from(k.version) ^ mix(k.user ^ mix(k.item ^ mix(k.context)))));
        (h % self.sets as u64) as usize * WAYS
    }

    /// The cached score of `k`, if present and fresh at `now_ns`.
    pub fn get(&mut self, k: &Key, now_ns: u64) -> Option<f32> {
        if !self.enabled() {
            return None;
        }
        let at = self.set_of(k);
        let found = self.entries[at..at + WAYS].iter().find(|e| e.expires_ns > now_ns && e.key == *k).map(|e| e.score);
        if found.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        found
    }

    pub fn put(&mut self, k: Key, score: f32, now_ns: u64) {
        if !self.enabled() {
            return;
        }
        let at = self.set_of(&k);
        let set = &mut self.entries[at..at + WAYS];
        let victim = match set.iter().position(|e| e.key == k || e.expires_ns <= now_ns) {
            Some(i) => i,
            None => (0..WAYS).min_by_key(|&i| set[i].expires_ns).expect("a set has ways"),
        };
        set[victim] = Entry { key: k, score, expires_ns: now_ns + self.ttl_ns.max(1) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(item: u64, version: u32) -> Key {
        Key { model: 1, version, user: 7, item, context: 9 }
    }

    #[test]
    fn hit_after_miss_and_expiry_after_ttl() {
        let mut c = ScoreCache::new(&CacheConfig { entries_max: 64, ttl_ms: 10, before_primary: false });
        assert_eq!(c.get(&key(1, 1), 0), None);
        c.put(key(1, 1), 0.25, 0);
        assert_eq!(c.get(&key(1, 1), 5_000_000), Some(0.25));
        assert_eq!(c.get(&key(1, 1), 10_000_000), None, "expired after the TTL");
        assert_eq!((c.hits, c.misses), (1, 2));
    }

    #[test]
    fn versions_never_mix() {
        let mut c = ScoreCache::new(&CacheConfig::default());
        c.put(key(1, 1), 0.25, 0);
        assert_eq!(c.get(&key(1, 2), 1), None);
        assert_eq!(c.get(&key(1, 1), 1), Some(0.25));
    }

    #[test]
    fn memory_is_bounded_and_recent_entries_survive() {
        let mut c = ScoreCache::new(&CacheConfig { entries_max: 16, ttl_ms: 1_000, before_primary: false });
        for i in 0..10_000u64 {
            c.put(key(i, 1), i as f32, i);
        }
        assert_eq!(c.entries.len(), 16);
        assert_eq!(c.get(&key(9_999, 1), 10_000), Some(9_999.0));
        let cached = (0..10_000u64).filter(|&i| c.get(&key(i, 1), 10_000).is_some()).count();
        assert!(cached <= 16);
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let mut c = ScoreCache::new(&CacheConfig { entries_max: 0, ttl_ms: 1_000, before_primary: false });
        c.put(key(1, 1), 0.5, 0);
        assert_eq!(c.get(&key(1, 1), 0), None);
        assert!(!c.enabled());
    }
}
