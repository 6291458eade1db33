//! Microbenchmarks of the request path's stages (criterion).
//!
//! - `wire`: verify + decode an auction-32 request; encode its response.
//! - `replica`: 1 + 32 lookups in a 1M-row × 32-float table, hits and misses,
//!   one at a time and batched with prefetch.
//! - `request`: the whole `RequestPath::handle` (decode → lookup → INT8 MLP
//!   → encode) on the demo data, and the protocol floor; and on the auction
//!   example's data (`request path auction`).
//! - `keys`: string keys against u64 keys (the same 1M rows × 32 floats
//!   keyed both ways, 1 + 32 lookups one by one and batched), and the fraud
//!   shape: five request-scope lookups in five groups, two of them by
//!   string key, against the auction-32 shape's 1 + 32.
//! - `request breakdown auction-32`: where one auction-32 request's time
//!   goes, over 65,536 distinct requests drawn across the demo's whole
//!   population: the whole `RequestPath::handle` and the INT8 kernel alone
//!   on the same 32 rows, per kernel (`amx`, `avx512-vnni`, where the CPU
//!   has them), and each stage around the kernel on its own (decode and
//!   verify, lookups and row assembly, the score cache, the response's
//!   encoding, the clock reads and stage timings). `bench/request_breakdown.sh`
//!   runs it and writes the table.
//! - `auction lookups`: the auction example's shape (3 request-scope
//!   lookups, one by string key, then 32 ads each joined to its campaign
//!   and advertiser through the rows' links, as the request path's
//!   `read_through` does) beside the auction-32 shape's 1 + 32 in one
//!   group, so their ratio reads off one run.
//!
//! Seeded and deterministic. `bench/run.sh` runs these and quotes medians.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use quiver::config::Limits;
use quiver::deadline::{Clock, MonotonicClock};
use quiver::features::groups::Absent;
use quiver::features::replica::{
    decode_link, key_hash, line_padding_helps, EntityKey, KeyKind, Replica, ReplicaBuilder, ReplicaHandle, Storage,
    KEY_BYTES_MAX,
};
use quiver::loadgen::auction;
use quiver::loadgen::demo::{self, SplitMix64, Workload};
use quiver::metrics::Readiness;
use quiver::metrics::{Stage, StageTimes};
use quiver::model::Model;
use quiver::registry::{Fit, Registry};
use quiver::request::cache::CacheConfig;
use quiver::request::cache::{hash_words, Key, ScoreCache};
use quiver::request::{RequestPath, Shared, SharedGroup};
use quiver::score::cpu::{configure_kernel, CpuInt8, Int8Kernel, KernelChoice};
use quiver::score::{Backend, BackendKind};
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
    g.bench_function("encode 32-score response", |b| b.iter(|| black_box(encode_scores(&mut enc, &scores, &mut out))));
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

/// Encodes an OK response carrying `scores` into `out` (cleared first), as
/// a request's respond stage does; returns its length.
fn encode_scores(enc: &mut ResponseEncoder, scores: &[f32], out: &mut Vec<u8>) -> usize {
    out.clear();
    enc.encode(
        &ResponseFields {
            request_id: 1,
            status: Status::Ok,
            scores: black_box(scores),
            tier: Tier::Primary,
            model_version: 1,
            server_us: 10,
            features_missing: 0,
            error: "",
            reason: quiver::wire::Reason::None,
            features_stale: false,
            explain: quiver::wire::ExplainFields::NONE,
        },
        out,
    );
    out.len()
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
/// its fingerprint for string keys; with `parents`, each row links to a
/// seeded one of the parent table's `parents` u64 keys (`2 × id` too).
/// Built once and kept in the scratch directory while its row count, key
/// kind and link kind still match.
fn keyed_table(name: &str, rows: u64, dim: u32, kind: KeyKind) -> Replica {
    linked_table(name, rows, dim, kind, None)
}

fn linked_table(name: &str, rows: u64, dim: u32, kind: KeyKind, parents: Option<u64>) -> Replica {
    let path = scratch("keys").join(format!("{name}.qrep"));
    let link = parents.map(|_| KeyKind::U64);
    // A file an older build wrote keeps its rows' layout: rebuilt when that
    // is not what this build writes, so the bench measures this build's.
    let shape = |r: &Replica| (r.header().row_count, r.key_kind(), r.link_kind(), r.header().line_aligned);
    let want = (rows, kind, link, line_padding_helps(dim, Storage::F32, kind, link));
    if Replica::open(&path, name).map(|r| shape(&r)).ok() != Some(want) {
        let mut b = ReplicaBuilder::new(name, dim);
        if let KeyKind::Str { bytes_max } = kind {
            b = b.str_keys(bytes_max).unwrap();
        }
        if let Some(kind) = link {
            b = b.links_to(kind).unwrap();
        }
        let mut rng = SplitMix64::new(9);
        let mut v = vec![0.0f32; dim as usize];
        for id in 0..rows {
            v.iter_mut().for_each(|x| *x = rng.normal());
            let parent = parents.map(|n| EntityKey::Id(rng.below(n) * 2));
            match kind {
                KeyKind::U64 => b.push_linked(EntityKey::Id(id * 2), &v, parent).unwrap(),
                KeyKind::Str { .. } => {
                    b.push_linked(EntityKey::Str(fingerprint(id * 2).as_bytes()), &v, parent).unwrap()
                }
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

/// One step of a lookup chain, as the request path's `read_through` takes
/// it: each row's key is the parent key in `links` (u64 here), read in
/// three passes so the loads overlap (index slots, then rows, then the
/// copies); an absent link reads the default row. `links_out` gets the
/// rows' own links for the next step (empty: none). Returns the rows missing.
fn read_through(
    table: &Replica,
    links: &[u32],
    link_words: usize,
    filed: &mut Vec<u64>,
    out: &mut [f32],
    links_out: &mut [u32],
) -> usize {
    let mut buf = [0u8; KEY_BYTES_MAX as usize];
    filed.clear();
    for link in links.chunks_exact(link_words) {
        let key = match decode_link(link, KeyKind::U64, &mut buf) {
            Some(EntityKey::Id(id)) => id,
            _ => u64::MAX,
        };
        table.prefetch_slot(key);
        filed.push(key);
    }
    for &key in filed.iter() {
        table.prefetch_row(key);
    }
    let (dim, kept) = (table.dim(), table.link_words());
    let mut missing = 0;
    for (i, (&key, dst)) in filed.iter().zip(out.chunks_exact_mut(dim)).enumerate() {
        let link_out = links_out.get_mut(i * kept..(i + 1) * kept).unwrap_or_default();
        let found = key != u64::MAX && table.read_linked_into(key, &[], dst, link_out);
        if key == u64::MAX {
            table.default_into(dst);
            link_out.fill(0);
        }
        missing += usize::from(!found);
    }
    missing
}

/// The auction example's lookups against the auction-32 shape's, in one
/// group: a user, a device (string key) and a publisher, then 32 ads, their
/// campaigns through the ads' links and their advertisers through the
/// campaigns'; populations as an ad platform's (1M users, devices and ads,
/// 100k campaigns, 10k advertisers).
fn auction_bench(c: &mut Criterion) {
    let items = big_table();
    let user = keyed_table("auser", 1_000_000, 16, KeyKind::U64);
    let device = keyed_table("adevice", 1_000_000, 8, FINGERPRINTS);
    let publisher = keyed_table("apublisher", 50_000, 8, KeyKind::U64);
    let advertiser = linked_table("aadvertiser", 10_000, 8, KeyKind::U64, None);
    let campaign = linked_table("acampaign", 100_000, 12, KeyKind::U64, Some(10_000));
    let ad = linked_table("aad", 1_000_000, 16, KeyKind::U64, Some(100_000));
    let mut rng = SplitMix64::new(13);
    // auction-32: 1 user + 32 items in the 1M x 32 table, as `keys` does.
    let sets: Vec<Vec<u64>> = (0..4096).map(|_| (0..33).map(|_| rng.below(TABLE_ROWS) * 2).collect()).collect();
    let draws: Vec<([u64; 2], String, Vec<u64>)> = (0..4096)
        .map(|_| {
            let request = [rng.below(1_000_000) * 2, rng.below(50_000) * 2];
            let device = fingerprint(rng.below(1_000_000) * 2);
            (request, device, (0..32).map(|_| rng.below(1_000_000) * 2).collect())
        })
        .collect();
    let mut out = vec![0.0f32; 33 * DIM as usize];
    let mut rows = vec![0u32; 33];
    let mut request_row = [0.0f32; 16 + 8 + 8];
    let (ad_lw, campaign_lw) = (ad.link_words(), campaign.link_words());
    let mut ad_out = vec![0.0f32; 32 * 16];
    let mut campaign_out = vec![0.0f32; 32 * 12];
    let mut advertiser_out = vec![0.0f32; 32 * 8];
    let mut ad_links = vec![0u32; 32 * ad_lw];
    let mut campaign_links = vec![0u32; 32 * campaign_lw];
    let mut filed = Vec::with_capacity(32);
    let mut g = c.benchmark_group("auction lookups");
    let mut i = 0;
    g.throughput(Throughput::Elements(33));
    g.bench_function("auction-32 shape: 1 user + 32 items, batched", |b| {
        b.iter(|| {
            i = (i + 1) % sets.len();
            black_box(items.read_many_into(&sets[i], &mut rows, &mut out, &mut []))
        })
    });
    let mut lookup = |(request, fp, ads): &([u64; 2], String, Vec<u64>)| {
        // The request-scope groups: slots, then rows, across the groups.
        let hash = key_hash(fp.as_bytes());
        user.prefetch_slot(request[0]);
        device.prefetch_slot(hash);
        publisher.prefetch_slot(request[1]);
        user.prefetch_row(request[0]);
        device.prefetch_row(hash);
        publisher.prefetch_row(request[1]);
        let (u, rest) = request_row.split_at_mut(16);
        let (d, p) = rest.split_at_mut(8);
        let mut missing = usize::from(!user.read_into(request[0], u));
        missing += usize::from(!device.read_str_into(fp.as_bytes(), d));
        missing += usize::from(!publisher.read_into(request[1], p));
        // The chain: ads batched, then each step keyed by the links before.
        missing += ad.read_many_into(ads, &mut rows, &mut ad_out, &mut ad_links);
        missing += read_through(&campaign, &ad_links, ad_lw, &mut filed, &mut campaign_out, &mut campaign_links);
        missing += read_through(&advertiser, &campaign_links, campaign_lw, &mut filed, &mut advertiser_out, &mut []);
        missing
    };
    // Every key and every link lands: nothing is missing.
    assert!(draws.iter().take(64).all(|d| lookup(d) == 0));
    g.throughput(Throughput::Elements(3 + 32 * 3));
    g.bench_function("auction shape: 3 request-scope + 32 ads x (ad, campaign, advertiser) via links", |b| {
        b.iter(|| {
            i = (i + 1) % draws.len();
            black_box(lookup(&draws[i]))
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
        let shared = Shared { floor, ..demo_shared(&dir, backend, cache) };
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

/// The demo's `Shared` for one backend and score cache (the protocol
/// floor off).
fn demo_shared(dir: &std::path::Path, backend: BackendKind, cache: CacheConfig) -> Shared {
    let fit = Fit::user_item(demo::EMBEDDING_DIM as usize, demo::EMBEDDING_DIM as usize, 256);
    let registry = Registry::single(&dir.join("model.qm"), fit, backend, 256).unwrap();
    Shared {
        registry: Arc::new(registry),
        groups: SharedGroup::user_item(
            Arc::new(ReplicaHandle::open(&dir.join("user.qrep"), "user").unwrap()),
            Arc::new(ReplicaHandle::open(&dir.join("item.qrep"), "item").unwrap()),
        ),
        canary_group: "user".into(),
        limits: Limits::default(),
        backend,
        floor: false,
        readiness: Arc::new(Readiness::ready()),
        admission: Default::default(),
        client_usage: Arc::new(quiver::request::admission::ClientUsage::new(&Default::default(), 1)),
        ladder: Default::default(),
        cache,
        shed: Default::default(),
        feed: None,
        fallback: None,
        shards: 1,
        decision_log: None,
    }
}

/// Distinct auction-32 frames whose ids are drawn over the demo's whole
/// population (100,000 users, 10,000 items).
const DISTINCT: u64 = 65_536;

/// Where one auction-32 request's time goes. Every stage bench cycles
/// through the same 65,536 distinct frames, so its replica rows, cache sets
/// and frame bytes are as cold as in `handle`'s; the stages are written
/// as the request path runs them (`src/request/stages.rs`), each on its own.
fn breakdown_bench(c: &mut Criterion) {
    let dir = scratch("demo");
    demo::ensure(&dir).unwrap();
    let frames: Vec<Vec<u8>> = (0..DISTINCT).map(|s| auction_request(1_000_000 + s)).collect();
    let payload = |i: usize| &frames[i][wire::FRAME_PREFIX_BYTES..];
    let limits = Limits::default();
    let request_limits = RequestLimits {
        frame_bytes_max: limits.frame_bytes_max,
        candidates_max: limits.candidates_max,
        context_len_max: limits.context_len_max,
    };
    let user = Replica::open(&dir.join("user.qrep"), "user").unwrap();
    let item = Replica::open(&dir.join("item.qrep"), "item").unwrap();
    let dim = demo::EMBEDDING_DIM as usize;
    let (rows, row_dim) = (32, 2 * dim + demo::CONTEXT_LEN);
    let mut x = vec![0.0f32; 256 * row_dim];
    let mut vectors = vec![0.0f32; 256 * dim];
    let mut found = vec![0u32; 256];
    let mut ids: Vec<u64> = Vec::with_capacity(256);
    // The model input rows of the first 64 requests, assembled as the path
    // assembles them, for the kernel alone.
    let mut assemble = |p: &[u8], x: &mut [f32]| {
        let r = wire::decode_request(p, &request_limits).unwrap();
        let x = &mut x[..r.candidates * row_dim];
        let mut missing = usize::from(!user.read_into(r.user_id(), &mut vectors[..dim]));
        for row in x.chunks_exact_mut(row_dim) {
            row[..dim].copy_from_slice(&vectors[..dim]);
        }
        ids.clear();
        ids.extend(r.item_ids().iter());
        let v = &mut vectors[..ids.len() * dim];
        missing += item.read_many_into(&ids, &mut found, v, &mut []);
        for (row, v) in x.chunks_exact_mut(row_dim).zip(v.chunks_exact(dim)) {
            row[dim..2 * dim].copy_from_slice(v);
        }
        let context = r.context();
        for row in x.chunks_exact_mut(row_dim) {
            for (d, c) in row[2 * dim..].iter_mut().zip(context.iter()) {
                *d = c;
            }
        }
        missing
    };
    let inputs: Vec<Vec<f32>> = (0..64)
        .map(|i| {
            let mut x = vec![0.0f32; rows * row_dim];
            assert_eq!(assemble(payload(i), &mut x), 0, "every demo id is in its table");
            x
        })
        .collect();
    let model = Arc::new(Model::load(&dir.join("model.qm")).unwrap());
    let mut g = c.benchmark_group("request breakdown auction-32");
    g.throughput(Throughput::Elements(1));
    for (kernel, choice) in [(Int8Kernel::Amx, KernelChoice::Amx), (Int8Kernel::Avx512Vnni, KernelChoice::Avx512Vnni)] {
        if !kernel.is_available() {
            eprintln!("request breakdown: skipped {}: not available on this CPU", kernel.name());
            continue;
        }
        configure_kernel(choice).unwrap();
        let shared = demo_shared(&dir, BackendKind::Int8, CacheConfig::default());
        let mut path = RequestPath::new(shared, MonotonicClock::new()).unwrap();
        let mut out = Vec::with_capacity(4096);
        let mut i = 0;
        g.bench_function(format!("handle, {}, {DISTINCT} distinct requests", kernel.name()), |b| {
            b.iter(|| {
                i = (i + 1) % frames.len();
                out.clear();
                let read_at_ns = path.clock().now_ns();
                path.handle(
                    payload(i),
                    read_at_ns,
                    0,
                    quiver::request::admission::Peer::at(std::net::Ipv4Addr::LOCALHOST.into()),
                    &mut out,
                );
                black_box(out.len())
            })
        });
        let mut backend = CpuInt8::with_kernel(&model, 256, kernel).unwrap();
        let mut logits = vec![0.0f32; rows];
        g.bench_function(format!("kernel alone, {}, 32 rows", kernel.name()), |b| {
            b.iter(|| {
                i = (i + 1) % inputs.len();
                backend.score(black_box(&inputs[i]), rows, &mut logits).unwrap();
                black_box(logits[0])
            })
        });
    }
    configure_kernel(KernelChoice::Auto).unwrap();
    let mut i = 0;
    g.bench_function("decode and verify", |b| {
        b.iter(|| {
            i = (i + 1) % frames.len();
            let r = wire::decode_request(black_box(payload(i)), &request_limits).unwrap();
            black_box(r.request_id())
        })
    });
    g.bench_function("lookups and row assembly", |b| {
        b.iter(|| {
            i = (i + 1) % frames.len();
            black_box(assemble(payload(i), &mut x))
        })
    });
    // Every candidate's key hashed into one request's cache key, the
    // lookup (a distinct request misses at its first candidate) and the
    // fill of all 32 after scoring.
    let mut cache = ScoreCache::new(&CacheConfig::default());
    let clock = MonotonicClock::new();
    let scores = [0.5f32; 32];
    let keys: Vec<(u64, Vec<u64>, Vec<f32>)> = frames
        .iter()
        .map(|f| {
            let r = wire::decode_request(&f[wire::FRAME_PREFIX_BYTES..], &request_limits).unwrap();
            (r.user_id(), r.item_ids().iter().collect(), r.context().iter().collect())
        })
        .collect();
    g.bench_function("score cache: key, look up, fill 32", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            let (user_id, items, context) = &keys[i];
            let now_ns = clock.now_ns();
            let key = Key {
                model: 1,
                version: 1,
                user: *user_id,
                item: 0,
                context: hash_words(context.iter().map(|c| u64::from(c.to_bits()))),
            };
            let hit = cache.get(&Key { item: items[0], ..key }, now_ns);
            cache.put_all(&key, items, &scores, now_ns);
            black_box(hit)
        })
    });
    let mut enc = ResponseEncoder::new(256);
    let mut out = Vec::with_capacity(4096);
    g.bench_function("respond: encode 32 scores", |b| b.iter(|| black_box(encode_scores(&mut enc, &scores, &mut out))));
    // What `handle` reads the clock for and records, per request: the
    // read time, then decode, lookup, kernel and respond each ended and
    // timed, and the whole.
    let mut times = StageTimes::default();
    g.bench_function("clock reads and stage timings", |b| {
        b.iter(|| {
            let mut last = clock.now_ns();
            for stage in [Stage::Decode, Stage::Lookup, Stage::Kernel, Stage::Respond] {
                let now = clock.now_ns();
                times.record_ns(stage, now - last);
                last = now;
            }
            times.record_ns(Stage::EndToEnd, black_box(last));
        })
    });
    g.finish();
}

/// The whole request path over the auction example (`loadgen::auction`):
/// 65,536 distinct auctions of 32 ads drawn Zipf over its populations,
/// each ad joined to its campaign and advertiser through the links, the
/// INT8 MLP; beside `request path auction-32`'s distinct-request figure.
fn auction_request_bench(c: &mut Criterion) {
    let dir = scratch("auction");
    auction::ensure(&dir).unwrap();
    let groups: Vec<SharedGroup> = auction::GROUPS
        .iter()
        .enumerate()
        .map(|(g, name)| SharedGroup {
            name: (*name).into(),
            scope: auction::SCOPES[g],
            absent: Absent::Reject,
            handle: Arc::new(ReplicaHandle::open(&dir.join(format!("{name}.qrep")), name).unwrap()),
            child: auction::PARENTS.iter().position(|p| p == &Some(*name)).map(|c| auction::GROUPS[c].into()),
            ttl_s: 0,
            nulls_missing: false,
        })
        .collect();
    let fit = Fit { groups: groups.iter().map(SharedGroup::fit).collect(), context_len_max: 256 };
    let registry = Registry::single(&dir.join("model.qm"), fit, BackendKind::Int8, 256).unwrap();
    let shared = Shared {
        registry: Arc::new(registry),
        groups,
        canary_group: auction::CANARY_GROUP.into(),
        limits: Limits::default(),
        backend: BackendKind::Int8,
        floor: false,
        readiness: Arc::new(Readiness::ready()),
        admission: Default::default(),
        client_usage: Arc::new(quiver::request::admission::ClientUsage::new(&Default::default(), 1)),
        ladder: Default::default(),
        cache: CacheConfig::default(),
        shed: Default::default(),
        feed: None,
        fallback: None,
        shards: 1,
        decision_log: None,
    };
    let mut auctions = auction::Auctions::new(&auction::MIX_DEFAULT, 1_000_000).unwrap();
    let mut spec = RequestSpec::default();
    let frames: Vec<Vec<u8>> = (0..65_536)
        .map(|n| {
            auctions.fill(n, &mut spec);
            spec.budget_us = 1_000_000;
            let mut frame = Vec::new();
            RequestEncoder::new().encode(&spec, &mut frame);
            frame
        })
        .collect();
    let mut path = RequestPath::new(shared, MonotonicClock::new()).unwrap();
    let mut out = Vec::with_capacity(4096);
    // Every auction is answered Ok with every row found.
    path.handle(
        &frames[0][wire::FRAME_PREFIX_BYTES..],
        path.clock().now_ns(),
        0,
        quiver::request::admission::Peer::at(std::net::Ipv4Addr::LOCALHOST.into()),
        &mut out,
    );
    let r = wire::decode_response(&out[wire::FRAME_PREFIX_BYTES..], 256).unwrap();
    assert_eq!((r.status, r.features_missing, r.scores.len()), (Status::Ok, 0, auction::CANDIDATES), "{r:?}");
    let mut g = c.benchmark_group("request path auction");
    g.throughput(Throughput::Elements(1));
    let mut i = 0;
    g.bench_function("handle, int8, 65536 distinct requests", |b| {
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
    targets = wire_bench, replica_bench, keys_bench, auction_bench, request_bench, auction_request_bench, breakdown_bench
}
criterion_main!(benches);
