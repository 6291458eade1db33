//! The score cache: one per shard, a rung of the degradation ladder.
//!
//! Key: (model name, model version, user id, item id, context hash); value:
//! the score and when it expires. The version is part of the key, so a new
//! version never serves an old version's scores.
//!
//! A fixed-size, 4-way set-associative table allocated at start-up: a key
//! hashes to one set of four entries, one 64-byte cache line; a miss that
//! must insert replaces an expired entry, else the one that expires first.
//! An entry is 16 bytes: the key's 64-bit hash (its tag), the score and the
//! expiry in ms. Matching by hash means two keys whose 64-bit hashes are
//! equal would share a score: about one chance in 2^62 per lookup, far below
//! any hardware error rate. Memory is bounded and known (`entries_max`
//! rounded up to a power of two, × 16 bytes), a lookup or insert touches one
//! cache line and never allocates, and with one TTL for all entries "expires
//! first" is "inserted first" within the set: FIFO per set, close to LRU for
//! the short TTLs a scoring cache uses. A request's inserts first hash every
//! key and prefetch every set, so their cache misses overlap instead of
//! queueing one after the other.

use serde::{Deserialize, Serialize};

const WAYS: usize = 4;
/// Longest TTL: expiries are ms in a u32 counted from an epoch the cache
/// moves (emptying itself) every `EPOCH_MS`, so one always fits.
pub const TTL_MS_MAX: u64 = 1 << 30;
const EPOCH_MS: u64 = 1 << 31;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Entries per shard, rounded up to a power of two (at least 4); 0
    /// disables the cache.
    pub entries_max: usize,
    /// At most `TTL_MS_MAX` (about 12 days).
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

/// Most entries per shard: the table is allocated at start-up, 16 bytes an
/// entry (256 MiB per shard at the bound).
pub const ENTRIES_MAX: usize = 1 << 24;

impl CacheConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.entries_max > ENTRIES_MAX {
            return Err(format!("cache.entries_max = {} is outside 0..={ENTRIES_MAX}", self.entries_max));
        }
        Ok(())
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

impl Key {
    /// The hash of everything but the item: the same for all of a request's
    /// candidates.
    fn request_hash(&self) -> u64 {
        mix(self.model ^ mix(u64::from(self.version) ^ mix(self.user ^ mix(self.context))))
    }
}

/// The key's hash, as stored; never 0 (0 marks an empty entry).
fn tag(request_hash: u64, item: u64) -> u64 {
    mix(request_hash ^ mix(item ^ 0x6974_656D)) | 1
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
struct Entry {
    /// 0: empty.
    tag: u64,
    score: f32,
    /// Ms since the cache's epoch.
    expires_ms: u32,
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Set([Entry; WAYS]);

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

/// Inserts hashed and prefetched together, at most this many at a time.
const PUT_CHUNK: usize = 64;

pub struct ScoreCache {
    sets: Vec<Set>,
    /// `sets.len() - 1`; the length is a power of two.
    mask: usize,
    ttl_ms: u32,
    epoch_ns: u64,
    pub hits: u64,
    pub misses: u64,
}

impl ScoreCache {
    pub fn new(config: &CacheConfig) -> ScoreCache {
        let sets = if config.entries_max == 0 { 0 } else { config.entries_max.div_ceil(WAYS).next_power_of_two() };
        ScoreCache {
            sets: vec![Set::default(); sets],
            mask: sets.saturating_sub(1),
            ttl_ms: config.ttl_ms.clamp(1, TTL_MS_MAX) as u32,
            epoch_ns: 0,
            hits: 0,
            misses: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        !self.sets.is_empty()
    }

    /// Entries the table holds.
    pub fn capacity(&self) -> usize {
        self.sets.len() * WAYS
    }

    /// `now_ns` in ms since the epoch; moves the epoch (emptying the table)
    /// once that would no longer fit an expiry in a u32.
    fn now_ms(&mut self, now_ns: u64) -> u32 {
        let mut ms = now_ns.saturating_sub(self.epoch_ns) / 1_000_000;
        if ms >= EPOCH_MS {
            self.sets.iter_mut().for_each(|s| *s = Set::default());
            self.epoch_ns = now_ns;
            ms = 0;
        }
        ms as u32
    }

    /// The cached score of `k`, if present and fresh at `now_ns`.
    pub fn get(&mut self, k: &Key, now_ns: u64) -> Option<f32> {
        if !self.enabled() {
            return None;
        }
        let now_ms = self.now_ms(now_ns);
        let t = tag(k.request_hash(), k.item);
        let set = &self.sets[t as usize & self.mask];
        let found = set.0.iter().find(|e| e.tag == t && e.expires_ms > now_ms).map(|e| e.score);
        if found.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        found
    }

    pub fn put(&mut self, k: Key, score: f32, now_ns: u64) {
        self.put_all(&k, &[k.item], &[score], now_ns);
    }

    /// Caches `scores[i]` for `items[i]` with the rest of the key from `k`.
    pub fn put_all(&mut self, k: &Key, items: &[u64], scores: &[f32], now_ns: u64) {
        assert_eq!(items.len(), scores.len());
        if !self.enabled() {
            return;
        }
        let now_ms = self.now_ms(now_ns);
        let expires_ms = now_ms + self.ttl_ms;
        let request_hash = k.request_hash();
        let mut tags = [0u64; PUT_CHUNK];
        for (items, scores) in items.chunks(PUT_CHUNK).zip(scores.chunks(PUT_CHUNK)) {
            for (t, &item) in tags.iter_mut().zip(items) {
                *t = tag(request_hash, item);
                prefetch(&self.sets[*t as usize & self.mask]);
            }
            for (&t, &score) in tags.iter().zip(scores) {
                let set = &mut self.sets[t as usize & self.mask].0;
                let victim = match set.iter().position(|e| e.tag == t || e.expires_ms <= now_ms) {
                    Some(i) => i,
                    None => (0..WAYS).min_by_key(|&i| set[i].expires_ms).expect("a set has ways"),
                };
                set[victim] = Entry { tag: t, score, expires_ms };
            }
        }
    }
}

#[inline]
fn prefetch(set: &Set) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it reads nothing architecturally and
    // cannot fault; the pointer is to a live set anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((set as *const Set).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = set;
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
        assert_eq!(c.capacity(), 16);
        assert_eq!(c.get(&key(9_999, 1), 10_000), Some(9_999.0));
        let cached = (0..10_000u64).filter(|&i| c.get(&key(i, 1), 10_000).is_some()).count();
        assert!(cached <= 16);
    }

    #[test]
    fn a_request_s_scores_go_in_together_and_each_comes_back() {
        let mut c = ScoreCache::new(&CacheConfig { entries_max: 1 << 12, ttl_ms: 1_000, before_primary: false });
        let items: Vec<u64> = (0..100).collect();
        let scores: Vec<f32> = items.iter().map(|&i| i as f32 / 100.0).collect();
        c.put_all(&key(0, 3), &items, &scores, 5);
        for (&i, &s) in items.iter().zip(&scores) {
            assert_eq!(c.get(&key(i, 3), 6), Some(s));
            assert_eq!(c.get(&Key { user: 8, ..key(i, 3) }, 6), None, "another user's key");
        }
        assert_eq!(c.capacity(), 1 << 12);
    }

    #[test]
    fn the_epoch_moves_without_serving_stale_scores() {
        let mut c = ScoreCache::new(&CacheConfig { entries_max: 64, ttl_ms: 1_000, before_primary: false });
        c.put(key(1, 1), 0.5, 0);
        let later = EPOCH_MS * 1_000_000 + 5;
        assert_eq!(c.get(&key(1, 1), later), None, "long expired");
        c.put(key(2, 1), 0.75, later);
        assert_eq!(c.get(&key(2, 1), later + 1), Some(0.75));
        assert_eq!(c.get(&key(2, 1), later + 1_000_000_001), None);
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let mut c = ScoreCache::new(&CacheConfig { entries_max: 0, ttl_ms: 1_000, before_primary: false });
        c.put(key(1, 1), 0.5, 0);
        assert_eq!(c.get(&key(1, 1), 0), None);
        assert!(!c.enabled());
    }
}
