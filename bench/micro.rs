//! Microbenchmarks of the request path's stages (criterion).
//!
//! - `wire`: verify + decode an auction-32 request; encode its response.
//! - `replica`: 1 + 32 lookups in a 1M-row × 32-float table, hits and misses,
//!   one at a time and batched with prefetch.
//! - `request`: the whole `RequestPath::handle` (decode → lookup → INT8 MLP
//!   → encode) on the demo data, and the protocol floor.
//! - `keys`: string keys against u64 keys (the same 1M rows × 32 floats
//!   keyed both ways, 1 + 32 lookups one by one and batched), and the fraud
//!   shape: five request-scope lookups in five groups, two of them by
//!   string key, against the auction-32 shape's 1 + 32.
//!
//! Seeded and deterministic. `bench/run.sh` runs these and quotes medians.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use quiver::config::Limits;
use quiver::deadline::{Clock, MonotonicClock};
use quiver::features::replica::{key_hash, KeyKind, Replica, ReplicaBuilder, ReplicaHandle};
use quiver::loadgen::demo::{self, SplitMix64, Workload};
use quiver::metrics::Readiness;
use quiver::registry::{Fit, Registry};
use quiver::request::cache::CacheConfig;
use quiver::request::{RequestPath, Shared, SharedGroup};
use quiver::score::BackendKind;
use quiver::wire::{self, RequestEncoder, RequestLimits, RequestSpec, ResponseEncoder, ResponseFields, Status, Tier};

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-bench-{name}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn auction_request(seed: u64) -> Vec<u8> {
    let mut spec = RequestSpec::default();
    Workload::auction32(seed).fill(1, &mut spec);
    spec.budget_us = 1_000_000;
    let mut frame = Vec::new();
    RequestEncoder::new().encode(&spec, &mut frame);
    frame
}

fn wire_bench(c: &mut Criterion) {
    let frame = auction_request(1);
    let payload = &frame[wire::FRAME_PREFIX_BYTES..];
    let limits = RequestLimits { frame_bytes_max: 65_536, candidates_max: 256, context_len_max: 256 };
    let mut g = c.benchmark_group("wire");
    g.bench_function("split+verify+read auction-32 request", |b| {
        b.iter(|| {
            let (p, _) = wire::split_frame(black_box(&frame), 65_536).unwrap().unwrap();
            let r = wire::decode_request(p, &limits).unwrap();
            let s: u64 = r.item_ids().iter().sum();
            black_box(s + r.user_id() + r.context().len() as u64)
        })
    });
    g.bench_function("verify only", |b| b.iter(|| wire::decode_request(black_box(payload), &limits).is_ok()));
    let scores = [0.5f32; 32];
    let mut enc = ResponseEncoder::new(256);
    let mut out = Vec::with_capacity(4096);
    g.bench_function("encode 32-score response", |b| {
        b.iter(|| {
            out.clear();
            enc.encode(
                &ResponseFields {
                    request_id: 1,
                    status: Status::Ok,
                    scores: black_box(&scores),
                    tier: Tier::Primary,
                    model_version: 1,
                    server_us: 10,
                    features_missing: 0,
                    error: "",
                    reason: quiver::wire::Reason::None,
                    features_stale: false,
                },
                &mut out,
            );
            black_box(out.len())
        })
    });
    g.finish();
}

const TABLE_ROWS: u64 = 1_000_000;
const DIM: u32 = 32;

fn big_table() -> Replica {
    let path = scratch("replica").join("item.qrep");
    if Replica::open(&path, "item").map(|r| r.header().row_count).ok() != Some(TABLE_ROWS) {
        let mut b = ReplicaBuilder::new("item", DIM);
        let mut rng = SplitMix64::new(7);
        let mut v = vec![0.0f32; DIM as usize];
        for id in 0..TABLE_ROWS {
            v.iter_mut().for_each(|x| *x = rng.normal());
            b.push(id * 2, &v).unwrap();
        }
        b.write(&path).unwrap();
    }
    Replica::open(&path, "item").unwrap()
}

fn replica_bench(c: &mut Criterion) {
    let table = big_table();
    let mut rng = SplitMix64::new(11);
    // 4096 request-sized key sets, so caches see a realistic spread.
    let hits: Vec<Vec<u64>> = (0..4096).map(|_| (0..33).map(|_| rng.below(TABLE_ROWS) * 2).collect()).collect();
    let misses: Vec<Vec<u64>> = (0..4096).map(|_| (0..33).map(|_| rng.below(TABLE_ROWS) * 2 + 1).collect()).collect();
    let mut out = vec![0.0f32; 33 * DIM as usize];
    let mut rows = vec![0u32; 33];
    let mut g = c.benchmark_group("replica 1M x 32 f32");
    g.throughput(Throughput::Elements(33));
    for (name, sets) in [("hit", &hits), ("miss", &misses)] {
        let mut i = 0;
        g.bench_function(format!("1+32 lookups, one by one, {name}"), |b| {
            b.iter(|| {
                i = (i + 1) % sets.len();
                let mut missing = 0;
                for (k, dst) in sets[i].iter().zip(out.chunks_exact_mut(DIM as usize)) {
                    missing += usize::from(!table.read_into(*k, dst));
                }
                black_box(missing)
            })
        });
        g.bench_function(format!("1+32 lookups, batched with prefetch, {name}"), |b| {
            b.iter(|| {
                i = (i + 1) % sets.len();
                black_box(table.read_many_into(&sets[i], &mut rows, &mut out, &mut []))
            })
        });
    }
    g.finish();
}

/// How the keys benches' string-keyed tables are keyed: a group of
/// 16-hex-character fingerprints declares `key_bytes_max = 16` (the fraud
/// example's device group does), so its rows hold 16 key bytes, not 64.
const FINGERPRINTS: KeyKind = KeyKind::Str { bytes_max: 16 };

/// A device fingerprint as the fraud shape's string keys are: 16 hex
/// characters, distinct per id.
fn fingerprint(id: u64) -> String {
    format!("{:016x}", id.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// A table of `rows` seeded rows keyed `2 × id`: by the id itself, or by
/// its fingerprint for string keys; built once and kept in the scratch
/// directory while its row count and key kind still match.
fn keyed_table(name: &str, rows: u64, dim: u32, kind: KeyKind) -> Replica {
    let path = scratch("keys").join(format!("{name}.qrep"));
    if Replica::open(&path, name).map(|r| (r.header().row_count, r.key_kind())).ok() != Some((rows, kind)) {
        let mut b = ReplicaBuilder::new(name, dim);
        if let KeyKind::Str { bytes_max } = kind {
            b = b.str_keys(bytes_max).unwrap();
        }
        let mut rng = SplitMix64::new(9);
        let mut v = vec![0.0f32; dim as usize];
        for id in 0..rows {
            v.iter_mut().for_each(|x| *x = rng.normal());
            match kind {
                KeyKind::U64 => b.push(id * 2, &v).unwrap(),
                KeyKind::Str { .. } => b.push_str(fingerprint(id * 2).as_bytes(), &v).unwrap(),
            }
        }
        b.write(&path).unwrap();
    }
    Replica::open(&path, name).unwrap()
}

fn keys_bench(c: &mut Criterion) {
    let ids = big_table();
    let strs = keyed_table("device", TABLE_ROWS, DIM, FINGERPRINTS);
    let mut rng = SplitMix64::new(11);
    let sets: Vec<Vec<u64>> = (0..4096).map(|_| (0..33).map(|_| rng.below(TABLE_ROWS) * 2).collect()).collect();
    // Each set's keys side by side in memory, as a request frame holds them.
    let str_sets: Vec<Vec<[u8; 16]>> = sets
        .iter()
        .map(|s| s.iter().map(|&id| fingerprint(id).into_bytes().try_into().expect("16 hex digits")).collect())
        .collect();
    let mut out = vec![0.0f32; 33 * DIM as usize];
    let mut rows = vec![0u32; 33];
    let mut hashes = vec![0u64; 33];
    let mut g = c.benchmark_group("keys 1M x 32 f32");
    g.throughput(Throughput::Elements(33));
    let mut i = 0;
    g.bench_function("1+32 u64 lookups, one by one", |b| {
        b.iter(|| {
            i = (i + 1) % sets.len();
            let mut missing = 0;
            for (k, dst) in sets[i].iter().zip(out.chunks_exact_mut(DIM as usize)) {
                missing += usize::from(!ids.read_into(*k, dst));
            }
            black_box(missing)
        })
    });
    g.bench_function("1+32 string lookups, one by one", |b| {
        b.iter(|| {
            i = (i + 1) % str_sets.len();
            let mut missing = 0;
            for (k, dst) in str_sets[i].iter().zip(out.chunks_exact_mut(DIM as usize)) {
                missing += usize::from(!strs.read_str_into(k, dst));
            }
            black_box(missing)
        })
    });
    g.bench_function("1+32 u64 lookups, batched", |b| {
        b.iter(|| {
            i = (i + 1) % sets.len();
            black_box(ids.read_many_into(&sets[i], &mut rows, &mut out, &mut []))
        })
    });
    g.bench_function("1+32 string lookups, batched", |b| {
        b.iter(|| {
            i = (i + 1) % str_sets.len();
            let keys = str_sets[i].iter().map(|k| &k[..]);
            black_box(strs.read_many_str_into(keys, &mut hashes, &mut rows, &mut out, &mut []))
        })
    });
    g.finish();

    // The fraud shape: card, account and merchant by u64, device and ip by
    // string, one row each, 8 floats wide; populations as a fraud team's.
    let card = keyed_table("card", 1_000_000, 8, KeyKind::U64);
    let account = keyed_table("account", 500_000, 8, KeyKind::U64);
    let merchant = keyed_table("merchant", 50_000, 8, KeyKind::U64);
    let device = keyed_table("fdevice", 1_000_000, 8, FINGERPRINTS);
    let ip = keyed_table("fip", 1_000_000, 8, FINGERPRINTS);
    let draws: Vec<[u64; 5]> = (0..4096)
        .map(|_| {
            [
                rng.below(1_000_000) * 2,
                rng.below(500_000) * 2,
                rng.below(50_000) * 2,
                rng.below(1_000_000) * 2,
                rng.below(1_000_000) * 2,
            ]
        })
        .collect();
    let draws_str: Vec<[String; 2]> = draws.iter().map(|d| [fingerprint(d[3]), fingerprint(d[4])]).collect();
    let mut row = [0.0f32; 5 * 8];
    let mut g = c.benchmark_group("request-scope lookups");
    g.throughput(Throughput::Elements(5));
    g.bench_function("fraud shape: 3 u64 + 2 string keys, 8 floats each", |b| {
        b.iter(|| {
            i = (i + 1) % draws.len();
            let (d, s) = (&draws[i], &draws_str[i]);
            let mut missing = 0;
            let mut parts = row.chunks_exact_mut(8);
            for (table, key) in [(&card, d[0]), (&account, d[1]), (&merchant, d[2])] {
                missing += usize::from(!table.read_into(key, parts.next().unwrap()));
            }
            for (table, key) in [(&device, &s[0]), (&ip, &s[1])] {
                missing += usize::from(!table.read_str_into(key.as_bytes(), parts.next().unwrap()));
            }
            black_box(missing)
        })
    });
    g.bench_function("fraud shape, slots then rows prefetched across groups", |b| {
        b.iter(|| {
            i = (i + 1) % draws.len();
            let (d, s) = (&draws[i], &draws_str[i]);
            let hashes = [key_hash(s[0].as_bytes()), key_hash(s[1].as_bytes())];
            card.prefetch_slot(d[0]);
            account.prefetch_slot(d[1]);
            merchant.prefetch_slot(d[2]);
            device.prefetch_slot(hashes[0]);
            ip.prefetch_slot(hashes[1]);
            card.prefetch_row(d[0]);
            account.prefetch_row(d[1]);
            merchant.prefetch_row(d[2]);
            device.prefetch_row(hashes[0]);
            ip.prefetch_row(hashes[1]);
            let mut missing = 0;
            let mut parts = row.chunks_exact_mut(8);
            for (table, key) in [(&card, d[0]), (&account, d[1]), (&merchant, d[2])] {
                missing += usize::from(!table.read_into(key, parts.next().unwrap()));
            }
            for (table, key) in [(&device, &s[0]), (&ip, &s[1])] {
                missing += usize::from(!table.read_str_into(key.as_bytes(), parts.next().unwrap()));
            }
            black_box(missing)
        })
    });
    g.finish();
}

fn request_bench(c: &mut Criterion) {
    let dir = scratch("demo");
    demo::ensure(&dir).unwrap();
    let mut g = c.benchmark_group("request path auction-32");
    g.throughput(Throughput::Elements(1));
    // 256 requests cycled keep their replica rows and the score cache hot;
    // 65,536 distinct requests (about 25 MB of frames) draw their ids over
    // all 100,000 users and 10,000 items, the cost a request sees in
    // service, and the figure to quote.
    let hot: Vec<Vec<u8>> = (0..256).map(auction_request).collect();
    let spread: Vec<Vec<u8>> = (0..65_536).map(|s| auction_request(1_000_000 + s)).collect();
    // The score cache is on by default and filled after every primary
    // answer; "cache off" is what that fill costs a request.
    let cache_off = CacheConfig { entries_max: 0, ..CacheConfig::default() };
    for (name, backend, floor, frames, cache) in [
        ("handle, int8", BackendKind::Int8, false, &hot, CacheConfig::default()),
        ("handle, f32", BackendKind::F32, false, &hot, CacheConfig::default()),
        ("handle, int8, 65536 distinct requests", BackendKind::Int8, false, &spread, CacheConfig::default()),
        ("handle, int8, 65536 distinct requests, cache off", BackendKind::Int8, false, &spread, cache_off),
        ("handle, f32, 65536 distinct requests", BackendKind::F32, false, &spread, CacheConfig::default()),
        ("protocol floor", BackendKind::Int8, true, &hot, CacheConfig::default()),
    ] {
        let fit = Fit::user_item(demo::EMBEDDING_DIM as usize, demo::EMBEDDING_DIM as usize, 256);
        let registry = Registry::single(&dir.join("model.qm"), fit, backend, 256).unwrap();
        let shared = Shared {
            registry: Arc::new(registry),
            groups: SharedGroup::user_item(
                Arc::new(ReplicaHandle::open(&dir.join("user.qrep"), "user").unwrap()),
                Arc::new(ReplicaHandle::open(&dir.join("item.qrep"), "item").unwrap()),
            ),
            canary_group: "user".into(),
            limits: Limits::default(),
            backend,
            floor,
            readiness: Arc::new(Readiness::ready()),
            admission: Default::default(),
            client_usage: Arc::new(quiver::request::admission::ClientUsage::new(&Default::default(), 1)),
            ladder: Default::default(),
            cache,
            shed: Default::default(),
            feed: None,
            fallback: None,
            shards: 1,
        };
        let mut path = RequestPath::new(shared, MonotonicClock::new()).unwrap();
        let mut out = Vec::with_capacity(4096);
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % frames.len();
                out.clear();
                let read_at_ns = path.clock().now_ns();
                path.handle(
                    &frames[i][wire::FRAME_PREFIX_BYTES..],
                    read_at_ns,
                    0,
                    quiver::request::admission::Peer::at(std::net::Ipv4Addr::LOCALHOST.into()),
                    &mut out,
                );
                black_box(out.len())
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = wire_bench, replica_bench, keys_bench, request_bench
}
criterion_main!(benches);
