//! The request path allocates nothing once warm: this binary's own global
//! allocator counts every allocation while a window is open, and
//! `RequestPath::handle` (with the completion of a handed-off request, in
//! thread mode) runs inside the window, inline and through the inference
//! stage. The count is process-wide, so it covers the stage thread too; the
//! tests take a lock so that one test's set-up does not fall in the other's
//! window.
//!
//! With the decision log on, the shard's logging (sample, encode into its
//! ring) runs inside the window as well. Every other request asks for
//! reason codes (the model is linear, so it is explained), so explaining
//! and encoding explanations run inside the window too.
//!
//! A rejected request may still allocate to format its error text (the
//! "model takes N floats" kind); none of the requests here is rejected.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use quiver::deadline::{Clock, MonotonicClock};
use quiver::decision_log::record::Decision;
use quiver::decision_log::{LogConfig, LogRings};
use quiver::features::groups::{Absent, Scope};
use quiver::features::replica::{ReplicaBuilder, ReplicaHandle};
use quiver::infer::{self, StageConfig};
use quiver::metrics::Readiness;
use quiver::model::layout::GroupFit;
use quiver::model::{GroupName, InputSegment, Layer, Model, Source};
use quiver::registry::{Fit, Registry};
use quiver::request::admission::{AdmissionConfig, ClientUsage, Peer};
use quiver::request::{Handled, Limits, RequestPath, Shared, SharedGroup};
use quiver::score::BackendKind;
use quiver::wire::{self, ExplainSkipped, GroupKeySpec, RequestEncoder, RequestSpec, Status, Tier, FRAME_PREFIX_BYTES};

/// Counts allocations (not frees) while `COUNTING` is set: all threads'
/// in `ALLOCATIONS`, this thread's in `MINE`.
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static MINE: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // A thread being torn down has no locals left; the global count
        // still has it.
        let _ = MINE.try_with(|m| m.set(m.get() + 1));
    }
}

// SAFETY: every call is passed to `System` unchanged; counting touches only
// atomics and a const-initialised thread local, neither of which allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One window at a time: the other test's set-up must not be counted.
static WINDOW: Mutex<()> = Mutex::new(());

/// Allocations made while `f` ran: (all threads, this thread).
fn counted(f: impl FnOnce()) -> (u64, u64) {
    let (all_before, mine_before) = (ALLOCATIONS.load(Ordering::SeqCst), MINE.with(Cell::get));
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    (ALLOCATIONS.load(Ordering::SeqCst) - all_before, MINE.with(Cell::get) - mine_before)
}

const ROWS_MAX: usize = 4;
/// Requests before the window (every buffer reaches its size, every
/// estimate settles) and inside it.
const WARM: u64 = 200;
const MEASURED: u64 = 500;

/// A four-input model over a user, an item and a context float; replicas
/// with two users and two items, so some lookups miss.
fn shared(name: &str) -> Shared {
    let dir = std::env::temp_dir().join(format!("quiver-alloc-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut u = ReplicaBuilder::new("user", 2);
    u.set_default(&[0.0, 0.0]).unwrap();
    u.push(1, &[1.0, 0.0]).unwrap();
    u.push(2, &[0.0, 1.0]).unwrap();
    u.write(&dir.join("user.qrep")).unwrap();
    let mut i = ReplicaBuilder::new("item", 1);
    i.set_default(&[-1.0]).unwrap();
    i.push(10, &[2.0]).unwrap();
    i.push(11, &[0.5]).unwrap();
    i.write(&dir.join("item.qrep")).unwrap();
    // Feature groups beyond user and item: string keys at request scope,
    // u64 keys at candidate scope.
    let mut d = ReplicaBuilder::new("device", 1).str_keys(16).unwrap();
    d.push_str(b"f7a9c2", &[0.5]).unwrap();
    d.write(&dir.join("device.qrep")).unwrap();
    let mut a = ReplicaBuilder::new("ad", 1);
    a.push(100, &[0.25]).unwrap();
    a.write(&dir.join("ad.qrep")).unwrap();
    let group = |name: &str, scope| Source::Group { name: GroupName::new(name).unwrap(), scope };
    let model = Model {
        name: "m".into(),
        version: 1,
        inputs: vec![
            InputSegment { source: Source::Item, dim: 1 },
            InputSegment { source: Source::Context, dim: 1 },
            InputSegment { source: Source::User, dim: 2 },
            InputSegment { source: group("device", Scope::Request), dim: 1 },
            InputSegment { source: group("ad", Scope::Candidate), dim: 1 },
        ],
        layers: vec![Layer::quantize(6, 1, false, vec![1.0, 2.0, 1.0, -1.0, 1.0, 1.0], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    let mut groups = SharedGroup::user_item(
        Arc::new(ReplicaHandle::open(&dir.join("user.qrep"), "user").unwrap()),
        Arc::new(ReplicaHandle::open(&dir.join("item.qrep"), "item").unwrap()),
    );
    for (name, scope) in [("device", Scope::Request), ("ad", Scope::Candidate)] {
        let handle = Arc::new(ReplicaHandle::open(&dir.join(format!("{name}.qrep")), name).unwrap());
        groups.push(SharedGroup {
            name: name.into(),
            scope,
            absent: Absent::Reject,
            handle,
            child: None,
            ttl_s: 0,
            nulls_missing: false,
        });
    }
    let mut fit = Fit::user_item(2, 1, 256);
    fit.groups.extend(groups[2..].iter().map(|g| GroupFit {
        name: g.name.clone(),
        scope: g.scope,
        dim: 1,
        child: None,
    }));
    Shared {
        registry: Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, ROWS_MAX).unwrap()),
        groups,
        canary_group: "user".into(),
        limits: Limits { candidates_max: ROWS_MAX, ..Limits::default() },
        backend: BackendKind::F32,
        floor: false,
        readiness: Arc::new(Readiness::ready()),
        admission: AdmissionConfig::default(),
        client_usage: Arc::new(ClientUsage::new(&AdmissionConfig::default(), 1)),
        cache: Default::default(),
        shed: Default::default(),
        feed: None,
        ladder: Default::default(),
        fallback: None,
        shards: 1,
        decision_log: None,
    }
}

/// Request frames, encoded ahead: users known and unknown, one to four
/// candidates (one unknown), with and without context, a device by string
/// key (known or not) and each candidate's ad; the odd ones ask for their
/// top 3 features, of all candidates or of the top one or two by score.
fn frames(n: u64) -> Vec<Vec<u8>> {
    let mut encoder = RequestEncoder::new();
    (0..n)
        .map(|i| {
            let spec = RequestSpec {
                request_id: i,
                // Ample: a loaded machine must not turn these into
                // step-downs, which are not what is measured.
                budget_us: 5_000_000,
                user_id: i % 4,
                item_ids: [10, 11, 12, 10][..1 + (i % 4) as usize].to_vec(),
                context: if i % 3 == 0 { Vec::new() } else { vec![0.25] },
                groups: vec![
                    ("device".into(), GroupKeySpec::Strs(vec![["f7a9c2", "unknown"][(i % 2) as usize].into()])),
                    ("ad".into(), GroupKeySpec::Ids([100, 101, 100, 102][..1 + (i % 4) as usize].to_vec())),
                ],
                explain_top_k: if i % 2 == 1 { 3 } else { 0 },
                explain_candidates_max: (i % 3) as u16,
                ..RequestSpec::default()
            };
            let mut frame = Vec::new();
            encoder.encode(&spec, &mut frame);
            frame
        })
        .collect()
}

const PEER: Peer<'static> = Peer { addr: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), tls_names: &[] };

/// Handles one frame to its response, appended to `out`: at once when
/// scored inline, else by waiting for the stage's completion.
fn answer(path: &mut RequestPath<MonotonicClock>, frame: &[u8], out: &mut Vec<u8>) -> Handled {
    let read_at_ns = path.clock().now_ns();
    let handled = path.handle(&frame[FRAME_PREFIX_BYTES..], read_at_ns, 0, PEER, out);
    if handled == Handled::Pending {
        loop {
            if let Some((conn, done, token)) = path.poll_stage() {
                assert_eq!(conn, 0, "the completion is connection 0's");
                assert!(path.complete(done, token, out), "answered: nothing was given up on");
                break;
            }
            std::hint::spin_loop();
        }
    }
    handled
}

/// Every response in `out` is the primary's `Ok`.
fn all_primary(out: &[u8], n: u64) {
    let mut rest = out;
    let mut seen = 0;
    while let Some((payload, used)) = wire::split_frame(rest, 1 << 16).unwrap() {
        let r = wire::decode_response(payload, 64).unwrap();
        assert_eq!((r.status, r.tier), (Status::Ok, Tier::Primary), "request {}: {}", r.request_id, r.error);
        let e = &r.explanations;
        assert_eq!(e.skipped, ExplainSkipped::None, "request {}", r.request_id);
        let asked = r.request_id % 2 == 1;
        let want = match r.request_id % 3 {
            0 => r.scores.len(),
            m => (m as usize).min(r.scores.len()),
        };
        assert_eq!(e.candidates.len(), if asked { want } else { 0 }, "request {}", r.request_id);
        assert_eq!(e.k(), if asked { 3 } else { 0 }, "request {}", r.request_id);
        rest = &rest[used..];
        seen += 1;
    }
    assert_eq!((seen, rest.len()), (n, 0), "one response per request, nothing else");
}

/// Warms `path` on the frames, then counts allocations over them again.
/// Returns how many of the measured requests were handed off.
fn warm_then_count(path: &mut RequestPath<MonotonicClock>, frames: &[Vec<u8>]) -> u64 {
    let mut out = Vec::with_capacity(frames.len() * quiver::request::response_frame_bytes_max(ROWS_MAX));
    for f in frames.iter().cycle().take(WARM as usize) {
        out.clear();
        answer(path, f, &mut out);
    }
    out.clear();
    let mut handed_off = 0;
    let (all, mine) = counted(|| {
        for f in frames.iter().take(MEASURED as usize) {
            handed_off += u64::from(answer(path, f, &mut out) == Handled::Pending);
        }
    });
    assert_eq!((all, mine), (0, 0), "allocations over {MEASURED} warm requests (all threads, the shard's)");
    all_primary(&out, MEASURED);
    handed_off
}

#[test]
fn handle_allocates_nothing_once_warm_inline() {
    let _window = WINDOW.lock().unwrap_or_else(|e| e.into_inner());
    let mut path = RequestPath::new(shared("inline"), MonotonicClock::new()).unwrap();
    let handed_off = warm_then_count(&mut path, &frames(MEASURED));
    assert_eq!(handed_off, 0, "no stage attached: every request is scored inline");
}

/// With the decision log sampling every decision, the shard encodes each
/// into its ring and still allocates nothing; every decision is there.
#[test]
fn handle_allocates_nothing_once_warm_logging_every_decision() {
    let _window = WINDOW.lock().unwrap_or_else(|e| e.into_inner());
    let config = LogConfig {
        dir: Some(std::env::temp_dir().join("quiver-alloc-declog-unused")),
        sample_rate: 1.0,
        ring_bytes: 8 << 20,
        ..LogConfig::default()
    };
    let rings = LogRings::new(&config, 1);
    let shared = Shared { decision_log: Some(rings.clone()), ..shared("logged") };
    let mut path = RequestPath::new(shared, MonotonicClock::new()).unwrap();
    path.set_shard(0);
    warm_then_count(&mut path, &frames(MEASURED));
    assert_eq!(path.telemetry.counters.log_records, WARM + MEASURED);
    assert_eq!(path.telemetry.counters.log_dropped_ring_full, 0);
    let mut consumer = rings.consumers().unwrap().remove(0);
    let mut ids = Vec::new();
    while let Some(d) = consumer.pop(|b| {
        let d = Decision::decode(b).unwrap();
        assert_eq!((d.status, d.tier), (Status::Ok.0, Tier::Primary.0));
        assert_eq!(d.x.map(|x| x.len()), Some(d.rows as usize * d.row_dim as usize));
        d.request_id
    }) {
        ids.push(d);
    }
    let want: Vec<u64> = (0..WARM).map(|i| i % MEASURED).chain(0..MEASURED).collect();
    assert_eq!(ids, want);
}

/// In thread mode, with the decision log sampling every decision: the
/// record begun at the hand-off and finished at the completion allocates
/// nothing either, and every decision is in the ring with its rows.
#[test]
fn handle_and_complete_allocate_nothing_once_warm_in_thread_mode() {
    let _window = WINDOW.lock().unwrap_or_else(|e| e.into_inner());
    let log = LogConfig {
        dir: Some(std::env::temp_dir().join("quiver-alloc-declog-unused")),
        sample_rate: 1.0,
        ring_bytes: 8 << 20,
        ..LogConfig::default()
    };
    let rings = LogRings::new(&log, 1);
    let shared = Shared { decision_log: Some(rings.clone()), ..shared("thread") };
    let config = StageConfig {
        batch_rows_max: ROWS_MAX,
        batch_wait_us_max: 0,
        // Parks at once: spinning would take a loaded machine's cores from
        // the shard it waits for.
        spin_us: 0,
        jobs_per_shard_max: 4,
        rows_per_job_max: ROWS_MAX,
        row_dim_max: 6,
        core: None,
        shares_core: false,
    };
    let (stage, mut ends) = infer::start(config, 1, shared.registry.clone(), BackendKind::F32, Arc::default()).unwrap();
    let mut path = RequestPath::new(shared, MonotonicClock::new()).unwrap();
    path.set_shard(0);
    path.attach_stage(ends.remove(0));
    let handed_off = warm_then_count(&mut path, &frames(MEASURED));
    assert_eq!(handed_off, MEASURED, "every request went through the stage");
    stage.stop();
    assert_eq!(path.telemetry.counters.log_records, WARM + MEASURED);
    let mut consumer = rings.consumers().unwrap().remove(0);
    let mut ids = Vec::new();
    while let Some(d) = consumer.pop(|b| {
        let d = Decision::decode(b).unwrap();
        assert_eq!((d.status, d.tier), (Status::Ok.0, Tier::Primary.0));
        assert_eq!(d.x.map(|x| x.len()), Some(d.rows as usize * d.row_dim as usize));
        assert!(!d.keys.is_empty() && !d.spans.is_empty(), "the spans and keys staged at the hand-off");
        d.request_id
    }) {
        ids.push(d);
    }
    let want: Vec<u64> = (0..WARM).map(|i| i % MEASURED).chain(0..MEASURED).collect();
    assert_eq!(ids, want);
}
