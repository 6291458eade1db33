//! Tests of the request path with a manual clock.

use super::*;
use crate::deadline::ManualClock;
use crate::features::replica::ReplicaBuilder;
use crate::model::{sigmoid, InputSegment, Layer, Source};
use crate::wire::{Reason, RequestEncoder, RequestSpec, Tier, FRAME_PREFIX_BYTES};

/// The peer of every test request.
const LOCAL: Peer<'static> = Peer { addr: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), tls_names: &[] };

fn shared(dir: &std::path::Path) -> Shared {
    let mut u = ReplicaBuilder::new("user", 2);
    u.set_default(&[0.0, 0.0]).unwrap();
    u.push(1, &[1.0, 0.0]).unwrap();
    u.write(&dir.join("user.qrep")).unwrap();
    let mut i = ReplicaBuilder::new("item", 1);
    i.set_default(&[-1.0]).unwrap();
    i.push(10, &[2.0]).unwrap();
    i.push(11, &[0.5]).unwrap();
    i.write(&dir.join("item.qrep")).unwrap();
    let model = Model {
        name: "m".into(),
        version: 4,
        inputs: vec![
            InputSegment { source: Source::Item, dim: 1 },
            InputSegment { source: Source::Context, dim: 1 },
            InputSegment { source: Source::User, dim: 2 },
        ],
        // logit = item + 2 * context + user[0] - user[1]
        layers: vec![Layer::quantize(4, 1, false, vec![1.0, 2.0, 1.0, -1.0], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    let fit = crate::registry::Fit::user_item(2, 1, 256);
    Shared {
        registry: Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, 4).unwrap()),
        groups: vec![
            group("user", Scope::Request, Arc::new(ReplicaHandle::open(&dir.join("user.qrep"), "user").unwrap())),
            group("item", Scope::Candidate, Arc::new(ReplicaHandle::open(&dir.join("item.qrep"), "item").unwrap())),
        ],
        canary_group: "user".into(),
        limits: Limits { candidates_max: 4, ..Limits::default() },
        backend: BackendKind::F32,
        floor: false,
        readiness: Arc::new(Readiness::ready()),
        admission: AdmissionConfig::default(),
        client_usage: Arc::new(crate::request::admission::ClientUsage::new(&AdmissionConfig::default(), 1)),
        cache: CacheConfig::default(),
        shed: ShedConfig::default(),
        feed: None,
        ladder: LadderConfig::default(),
        fallback: None,
        shards: 1,
        decision_log: None,
    }
}

/// A served group with the legacy groups' policy (a missing key reads the
/// default row).
fn group(name: &str, scope: Scope, handle: Arc<ReplicaHandle>) -> SharedGroup {
    SharedGroup {
        name: name.into(),
        scope,
        absent: crate::features::groups::Absent::Default,
        handle,
        child: None,
        ttl_s: 0,
        nulls_missing: false,
    }
}

fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-request-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(path: &mut RequestPath<&ManualClock>, spec: &RequestSpec, read_at_us: u64) -> wire::Response {
    let mut frame = Vec::new();
    RequestEncoder::new().encode(spec, &mut frame);
    let mut out = Vec::new();
    assert_eq!(path.handle(&frame[FRAME_PREFIX_BYTES..], read_at_us * 1_000, 0, LOCAL, &mut out), Handled::Answered);
    let (payload, used) = wire::split_frame(&out, 1 << 16).unwrap().unwrap();
    assert_eq!(used, out.len(), "exactly one response frame");
    wire::decode_response(payload, 64).unwrap()
}

fn spec() -> RequestSpec {
    RequestSpec {
        request_id: 77,
        budget_us: 1_000,
        user_id: 1,
        item_ids: vec![10, 11, 12],
        context: vec![0.25],
        ..RequestSpec::default()
    }
}

#[test]
fn scores_follow_the_input_layout() {
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(shared(&dir("layout")), &clock).unwrap();
    let r = run(&mut path, &spec(), 1_000);
    assert_eq!((r.request_id, r.status, r.tier, r.model_version), (77, Status::Ok, Tier::Primary, 4));
    // item 12 is unknown: its default vector (-1) is used and counted.
    let want = [2.0 + 0.5 + 1.0, 0.5 + 0.5 + 1.0, -1.0 + 0.5 + 1.0].map(sigmoid);
    assert_eq!(r.scores, want);
    assert_eq!(r.features_missing, 1);

    let mut unknown_user = spec();
    unknown_user.user_id = 99;
    unknown_user.context.clear();
    let r = run(&mut path, &unknown_user, 1_000);
    assert_eq!(r.scores, [2.0, 0.5, -1.0].map(sigmoid));
    assert_eq!(r.features_missing, 2);
    assert_eq!(path.telemetry.counters.by_status[0], 2);
}

/// The rows `spec()` assembles, in the model's layout (item, context,
/// user[0], user[1]), item 12 at its default.
fn spec_rows() -> Vec<f32> {
    vec![2.0, 0.25, 1.0, 0.0, 0.5, 0.25, 1.0, 0.0, -1.0, 0.25, 1.0, 0.0]
}

#[test]
fn raw_rows_score_as_the_same_rows_looked_up() {
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(shared(&dir("raw")), &clock).unwrap();
    let keyed = run(&mut path, &spec(), 1_000);
    let raw =
        RequestSpec { request_id: 78, budget_us: 1_000, rows: spec_rows(), row_count: 3, ..RequestSpec::default() };
    let r = run(&mut path, &raw, 1_000);
    assert_eq!((r.request_id, r.status, r.tier, r.model_version), (78, Status::Ok, Tier::Primary, 4));
    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&r.scores), bits(&keyed.scores));
    // Nothing was looked up, so nothing is missing.
    assert_eq!((keyed.features_missing, r.features_missing), (1, 0));
    // A NaN is sent on to the kernel, which reads it as it reads a missing
    // looked-up value; the other candidates are untouched.
    let mut rows = spec_rows();
    rows[4] = f32::NAN;
    let r = run(&mut path, &RequestSpec { rows, ..raw.clone() }, 1_000);
    assert_eq!(r.status, Status::Ok);
    assert_eq!((r.scores[0], r.scores[2]), (keyed.scores[0], keyed.scores[2]));
    assert_ne!(r.scores[1], keyed.scores[1]);
    // Rows of another width than the model's: refused, saying both.
    let narrow = RequestSpec { rows: vec![1.0; 9], ..raw.clone() };
    let r = run(&mut path, &narrow, 1_000);
    assert_eq!((r.status, r.request_id), (Status::BadRequest, 78));
    assert!(r.error.contains("3 rows of 3 floats") && r.error.contains("rows of 4"), "{}", r.error);
    // Keys beside rows: refused at decode.
    let r = run(&mut path, &RequestSpec { user_id: 1, ..raw.clone() }, 1_000);
    assert_eq!(r.status, Status::BadRequest);
    assert!(r.error.contains("user_id"), "{}", r.error);
}

#[test]
fn raw_rows_are_cached_by_their_values() {
    let clock = ManualClock::new(1_000);
    let mut shared = shared(&dir("raw-cache"));
    shared.cache = CacheConfig { before_primary: true, ..CacheConfig::default() };
    let mut path = RequestPath::new(shared, &clock).unwrap();
    let raw = RequestSpec { budget_us: 1_000, rows: spec_rows(), row_count: 3, ..RequestSpec::default() };
    assert_eq!(run(&mut path, &raw, 1_000).tier, Tier::Primary);
    let again = run(&mut path, &raw, 1_000);
    assert_eq!((again.tier, again.status), (Tier::Cached, Status::Ok));
    // One float changed: that candidate is not cached, so the primary answers.
    let mut rows = spec_rows();
    rows[8] = -2.0;
    let changed = run(&mut path, &RequestSpec { rows, ..raw.clone() }, 1_000);
    assert_eq!(changed.tier, Tier::Primary);
    assert_eq!(changed.scores[..2], again.scores[..2]);
    assert_ne!(changed.scores[2], again.scores[2]);
    // The keyed request whose rows these are does not read their entries:
    // keys and rows hash apart.
    assert_eq!(run(&mut path, &spec(), 1_000).tier, Tier::Primary);
}

#[test]
fn each_stage_boundary_enforces_the_deadline() {
    // Every clock read advances time by `step`; the request's budget runs
    // out at a different boundary for each step size.
    let mut seen = std::collections::BTreeSet::new();
    let shared = shared(&dir("stages"));
    for step in [1u64, 100, 249, 250, 300, 499, 500, 700, 999, 1_000, 1_500] {
        let clock = ManualClock::new(0);
        let mut path = RequestPath::new(shared.clone(), &clock).unwrap();
        clock.set_step_us(step);
        let mut s = spec();
        s.budget_us = 1_000;
        let read_at = clock.now_us();
        let r = run(&mut path, &s, read_at);
        let now = clock.now_us();
        if r.status == Status::Ok {
            assert!(now - read_at <= 1_000 + 2 * step, "ok answer at {now} for read at {read_at}");
        } else {
            assert_eq!(r.status, Status::DeadlineExceeded);
            assert!(r.scores.is_empty());
            seen.insert(r.error.clone());
        }
    }
    assert_eq!(seen.len(), 3, "all three deadline checks fired: {seen:?}");
    assert!(seen.contains("budget spent during lookup"), "{seen:?}");
}

#[test]
fn budget_smaller_than_the_kernel_cost_steps_down_up_front() {
    let clock = ManualClock::new(0);
    let mut path = RequestPath::new(shared(&dir("cost")), &clock).unwrap();
    path.versions.served[0].kernel_cost.ns_per_row = 50_000.0; // 50 µs per row
    let mut s = spec();
    s.budget_us = 100; // 3 rows need 150 µs
    let r = run(&mut path, &s, 0);
    // No fallback model here: the static default answers, in time.
    assert_eq!((r.status, r.tier, r.reason), (Status::Ok, Tier::Default, Reason::Budget));
    assert_eq!(r.scores, vec![0.0; 3]);
    s.budget_us = 200;
    let r = run(&mut path, &s, 0);
    assert_eq!((r.status, r.tier, r.reason), (Status::Ok, Tier::Primary, Reason::None));
}

#[test]
fn explanations_come_only_when_the_time_left_fits_their_measured_cost() {
    use crate::score::explaining::Explaining;
    use crate::wire::ExplainSkipped;
    let clock = ManualClock::new(0);
    let mut path = RequestPath::new(shared(&dir("explain")), &clock).unwrap();
    let Explaining::Ready(ready) = &mut path.versions.served[0].explaining else {
        panic!("a one-layer linear model is explainable")
    };
    ready.ns_per_candidate = 100_000.0; // 100 µs per candidate
    let scores = [2.0 + 0.5 + 1.0, 0.5 + 0.5 + 1.0, -1.0 + 0.5 + 1.0].map(sigmoid);
    let mut s = RequestSpec { explain_top_k: 2, budget_us: 250, ..spec() };
    // Three candidates need 300 µs: the scores, and why no reasons.
    let r = run(&mut path, &s, 0);
    assert_eq!((r.status, r.tier, r.scores.as_slice()), (Status::Ok, Tier::Primary, &scores[..]));
    assert_eq!((r.explanations.skipped, r.explanations.candidates.len()), (ExplainSkipped::Budget, 0));
    assert_eq!(path.telemetry.counters.explain_skipped_budget, 1);
    // The top two by score need 200 µs: explained. logit = item + 2 ctx +
    // user[0] - user[1] over the row (item, ctx, user[0], user[1]), whose
    // contributions are each weight times its input (no scaler: baseline 0).
    s.explain_candidates_max = 2;
    let r = run(&mut path, &s, 0);
    assert_eq!(r.scores, scores);
    let e = &r.explanations;
    assert_eq!((e.skipped, e.candidates.as_slice(), e.bias), (ExplainSkipped::None, &[0, 1][..], 0.0));
    let top: Vec<Vec<(u32, f64)>> = e.iter().map(|(_, t)| t.collect()).collect();
    // Candidate 1: item 0.5 and 2 ctx 0.5 tie; the lower index first.
    assert_eq!(top, [vec![(0, 2.0), (2, 1.0)], vec![(2, 1.0), (0, 0.5)]]);
    assert_eq!(path.telemetry.counters.explained_candidates, 2);
    // What the explainer took (no time on this clock) moves the estimate.
    let Explaining::Ready(ready) = &path.versions.served[0].explaining else { unreachable!() };
    assert!(ready.ns_per_candidate < 100_000.0);
    // Not asked: nothing.
    let r = run(&mut path, &RequestSpec { explain_top_k: 0, ..s.clone() }, 0);
    assert_eq!(r.explanations, wire::Explanations::default());
    // A lower rung (here the cache, which the answers above filled)
    // explains nothing and says so.
    path.versions.served[0].kernel_cost.ns_per_row = 1e9;
    let r = run(&mut path, &s, 0);
    assert_eq!((r.tier, r.explanations.skipped), (Tier::Cached, ExplainSkipped::LowerRung));
    // A model the explainer refused.
    path.versions.served[0].kernel_cost.ns_per_row = 0.0;
    path.versions.served[0].explaining = Explaining::Refused("an MLP".into());
    let r = run(&mut path, &s, 0);
    assert_eq!((r.tier, r.explanations.skipped), (Tier::Primary, ExplainSkipped::NotExplainable));
}

#[test]
fn shards_share_one_explainer_per_version_and_the_fallback_builds_none() {
    use crate::score::explaining::Explaining;
    let clock = ManualClock::new(0);
    let mut shared = shared(&dir("explain_shared"));
    let fallback = shared.registry.snapshot().models[0].as_ref().clone();
    shared.fallback = Some(Arc::new(Model { name: "fallback".into(), ..fallback }));
    // Two shards of one process: one table, two scratches.
    let a = RequestPath::new(shared.clone(), &clock).unwrap();
    let b = RequestPath::new(shared.clone(), &clock).unwrap();
    let (Explaining::Ready(ea), Explaining::Ready(eb)) =
        (&a.versions.served[0].explaining, &b.versions.served[0].explaining)
    else {
        panic!("a one-layer linear model is explainable")
    };
    assert!(Arc::ptr_eq(ea.explainer(), eb.explainer()), "each shard built its own explainer");
    assert_eq!(shared.registry.explainers_held(), 1);
    // The fallback never explains: nothing is built for it.
    assert!(matches!(a.versions.fallback.as_ref().map(|f| &f.explaining), Some(Explaining::Unused)));
}

#[test]
fn bad_requests_get_typed_answers() {
    let clock = ManualClock::new(0);
    let mut path = RequestPath::new(shared(&dir("bad")), &clock).unwrap();
    let mut s = spec();
    s.item_ids = vec![1; 5];
    let r = run(&mut path, &s, 0);
    assert_eq!((r.request_id, r.status), (77, Status::BadRequest));
    assert!(r.error.contains("5 candidates exceed the limit of 4"), "{}", r.error);

    let mut s = spec();
    s.context = vec![1.0, 2.0];
    assert_eq!(run(&mut path, &s, 0).status, Status::BadRequest);

    let mut s = spec();
    s.model = "other".into();
    assert_eq!(run(&mut path, &s, 0).status, Status::ModelNotFound);
    s.model = "m".into();
    assert_eq!(run(&mut path, &s, 0).status, Status::Ok);

    let mut out = Vec::new();
    path.handle(b"definitely not a flatbuffer", 0, 0, LOCAL, &mut out);
    let (payload, _) = wire::split_frame(&out, 1 << 16).unwrap().unwrap();
    let r = wire::decode_response(payload, 64).unwrap();
    assert_eq!((r.request_id, r.status), (0, Status::BadRequest));
}

#[test]
fn the_floor_answers_without_scoring() {
    let clock = ManualClock::new(0);
    let mut sh = shared(&dir("floor"));
    sh.floor = true;
    let mut path = RequestPath::new(sh, &clock).unwrap();
    let r = run(&mut path, &spec(), 0);
    assert_eq!((r.request_id, r.status, r.tier), (77, Status::Ok, Tier::Primary));
    assert!(r.scores.is_empty());
    assert_eq!(path.telemetry.counters.candidates_scored, 0);
}

#[test]
fn budget_zero_means_default_and_large_budgets_are_clamped() {
    let clock = ManualClock::new(0);
    let mut path = RequestPath::new(shared(&dir("budget")), &clock).unwrap();
    let mut s = spec();
    s.budget_us = 0;
    clock.set_step_us(2_000); // default budget is 10 ms; five reads fit
    assert_eq!(run(&mut path, &s, clock.now_us()).status, Status::Ok);
    path.policies.limits.budget_us_max = 10_000;
    s.budget_us = u32::MAX;
    clock.set_step_us(6_000);
    assert_eq!(run(&mut path, &s, clock.now_us()).status, Status::DeadlineExceeded);
}

/// A request's frame payload.
fn payload(spec: &RequestSpec) -> Vec<u8> {
    let mut frame = Vec::new();
    RequestEncoder::new().encode(spec, &mut frame);
    frame.split_off(FRAME_PREFIX_BYTES)
}

fn decode(out: &[u8]) -> wire::Response {
    let (payload, used) = wire::split_frame(out, 1 << 16).unwrap().unwrap();
    assert_eq!(used, out.len(), "exactly one response frame");
    wire::decode_response(payload, 64).unwrap()
}

#[test]
fn a_long_wait_in_the_read_buffer_sheds_low_priorities_before_lookup() {
    let clock = ManualClock::new(1_000_000);
    let mut sh = shared(&dir("shed"));
    sh.shed = ShedConfig { enabled: true, ..ShedConfig::default() };
    let mut path = RequestPath::new(sh, &clock).unwrap();
    let (mut low, mut high) = (spec(), spec());
    high.priority = 9;
    // Read 100 µs ago (a tenth of queue_delay_max_us): nothing is shed.
    assert_eq!(run(&mut path, &low, 999_900).status, Status::Ok);
    // Requests that waited half of queue_delay_max_us raise the level a
    // quarter band each millisecond.
    for _ in 0..5 {
        clock.advance_us(1_000);
        assert_eq!(run(&mut path, &high, clock.now_us() - 500).status, Status::Ok);
    }
    let missing = path.telemetry.counters.features_missing;
    let r = run(&mut path, &low, clock.now_us() - 500);
    assert_eq!(
        (r.status, r.error.as_str()),
        (Status::Overloaded, "shed: over capacity, priority below the shed level")
    );
    assert_eq!(path.telemetry.counters.features_missing, missing, "no lookup for a shed request");
    assert_eq!(run(&mut path, &high, clock.now_us() - 500).status, Status::Ok, "priority 9 is four bands up");
    assert_eq!(path.telemetry.counters.shed_by_band[0], 1);
    assert_eq!(path.telemetry.counters.shed_level_milli, 1_250);
    // No more waiting; after release_ms (50 ms per band) priority 0 is back.
    low.request_id = 78;
    clock.advance_us(10_000);
    assert_eq!(run(&mut path, &low, clock.now_us()).status, Status::Overloaded, "10 ms is not enough");
    clock.advance_us(90_000);
    assert_eq!(run(&mut path, &low, clock.now_us()).status, Status::Ok);
    assert_eq!(path.telemetry.counters.shed_by_band[0], 2);
}

#[test]
fn a_priority_above_the_clients_ceiling_is_shed_as_the_ceiling() {
    let clock = ManualClock::new(1_000_000);
    let mut sh = shared(&dir("shed-ceiling"));
    sh.shed = ShedConfig { enabled: true, ..ShedConfig::default() };
    // Unknown clients are shed as priority 0 at most, whatever they ask.
    sh.admission.unknown_priority_max = 0;
    sh.client_usage = Arc::new(crate::request::admission::ClientUsage::new(&sh.admission, 1));
    let mut path = RequestPath::new(sh, &clock).unwrap();
    let mut claims_top = spec();
    claims_top.priority = 255;
    // Raise the shed level past band 0, as in the test above.
    for _ in 0..5 {
        clock.advance_us(1_000);
        run(&mut path, &claims_top, clock.now_us() - 500);
    }
    let r = run(&mut path, &claims_top, clock.now_us() - 500);
    assert_eq!(
        (r.status, r.error.as_str()),
        (Status::Overloaded, "shed: over capacity, priority below the shed level"),
        "priority 255 from an unknown client is shed as 0"
    );
    assert!(path.telemetry.counters.shed_by_band[0] >= 1 && path.telemetry.counters.shed_by_band[8] == 0);
}

#[test]
fn shed_requests_can_get_the_static_default() {
    let clock = ManualClock::new(1_000_000);
    let mut sh = shared(&dir("shed-default"));
    sh.shed = ShedConfig { enabled: true, answer: crate::request::shed::ShedAnswer::Default, ..ShedConfig::default() };
    sh.ladder.default_score = 0.125;
    let mut path = RequestPath::new(sh, &clock).unwrap();
    let mut s = spec();
    s.budget_us = 10_000;
    for _ in 0..4 {
        clock.advance_us(1_000);
        run(&mut path, &s, clock.now_us() - 2_000);
    }
    let r = run(&mut path, &s, clock.now_us() - 2_000);
    assert_eq!((r.status, r.tier, r.reason), (Status::Ok, Tier::Default, Reason::Overload));
    assert_eq!(r.scores, vec![0.125; 3]);
}

/// A request path handing off to a real inference stage, with a manual
/// clock kept on the stage's (monotonic) time line.
fn threaded<'c>(
    name: &str,
    faults: Arc<crate::infer::Faults>,
    clock: &'c ManualClock,
) -> (RequestPath<&'c ManualClock>, crate::infer::Stage) {
    let sh = shared(&dir(name));
    let config = crate::infer::StageConfig {
        batch_rows_max: 16,
        batch_wait_us_max: 0,
        spin_us: 100,
        jobs_per_shard_max: 4,
        rows_per_job_max: 4,
        row_dim_max: 4,
        core: None,
        shares_core: false,
    };
    let (stage, mut ends) = crate::infer::start(config, 1, sh.registry.clone(), BackendKind::F32, faults).unwrap();
    let mut path = RequestPath::new(sh, clock).unwrap();
    path.attach_stage(ends.pop().unwrap());
    (path, stage)
}

/// Hands `spec` off and answers it from the stage's completion.
fn through_stage(path: &mut RequestPath<&ManualClock>, spec: &RequestSpec) -> wire::Response {
    let mut out = Vec::new();
    let read_at_ns = path.clock().now_ns();
    assert_eq!(path.handle(&payload(spec), read_at_ns, 0, LOCAL, &mut out), Handled::Pending);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some((conn, done, token)) = path.poll_stage() {
            assert_eq!(conn, 0);
            assert!(path.complete(done, token, &mut out), "a request not given up on is answered");
            return decode(&out);
        }
        assert!(std::time::Instant::now() < until, "the stage never answered");
        std::thread::yield_now();
    }
}

/// Gives up on the requests overdue at `now_ns` and answers each as its
/// connection does: (connection, response bytes).
fn give_ups(path: &mut RequestPath<&ManualClock>, now_ns: u64) -> Vec<(u32, Vec<u8>)> {
    let mut due = Vec::new();
    path.give_up_overdue(now_ns, &mut |conn, slot| due.push((conn, slot)));
    let mut answers = Vec::new();
    for (conn, slot) in due {
        let mut out = Vec::new();
        path.give_up(slot, &mut out);
        answers.push((conn, out));
    }
    answers
}

#[test]
fn stage_scores_fill_the_cache() {
    let clock = ManualClock::new(crate::deadline::MonotonicClock::new().now_us());
    let (mut path, stage) = threaded("stage-cache", Arc::default(), &clock);
    path.policies.cache_before_primary = true;
    let mut s = spec();
    s.budget_us = 1_000_000;
    let first = through_stage(&mut path, &s);
    assert_eq!((first.status, first.tier), (Status::Ok, Tier::Primary));
    // The repeat is answered from the cache, inline, with the same scores.
    let r = run(&mut path, &s, clock.now_us());
    assert_eq!((r.status, r.tier, r.scores), (Status::Ok, Tier::Cached, first.scores));
    stage.stop();
}

#[test]
fn a_give_up_answers_from_the_cache() {
    let faults = Arc::new(crate::infer::Faults::default());
    let clock = ManualClock::new(crate::deadline::MonotonicClock::new().now_us());
    let (mut path, stage) = threaded("stage-give-up", faults.clone(), &clock);
    let mut s = spec();
    s.budget_us = 1_000_000;
    let first = through_stage(&mut path, &s);
    assert_eq!((first.status, first.tier), (Status::Ok, Tier::Primary));
    // The stage turns slow; the same request is given up on at its
    // deadline less the reserve and answered from the cache rung.
    faults.set_stage_delay_us(20_000);
    let mut out = Vec::new();
    let read_at_ns = clock.now_ns();
    assert_eq!(path.handle(&payload(&s), read_at_ns, 0, LOCAL, &mut out), Handled::Pending);
    let mut answers = Vec::new();
    answers.extend(give_ups(&mut path, read_at_ns + 500_000_000));
    assert!(answers.is_empty(), "not yet due");
    clock.advance_us(1_000_000 - path.policies.ladder.reserve_us);
    let now_ns = clock.now_ns();
    answers.extend(give_ups(&mut path, now_ns));
    assert_eq!(answers.len(), 1);
    let r = decode(&answers[0].1);
    assert_eq!((r.status, r.tier, r.reason), (Status::Ok, Tier::Cached, Reason::Budget));
    assert_eq!(r.scores, first.scores);
    // Past the TTL nothing is cached: a give-up then falls to the default.
    clock.advance_us(61_000_000);
    let read_at_ns = path.clock().now_ns();
    s.request_id = 78;
    assert_eq!(path.handle(&payload(&s), read_at_ns, 0, LOCAL, &mut out), Handled::Pending);
    clock.advance_us(1_000_000);
    let now_ns = clock.now_ns();
    answers.clear();
    answers.extend(give_ups(&mut path, now_ns));
    assert_eq!(answers.len(), 1);
    assert_eq!(decode(&answers[0].1).tier, Tier::Default);
    faults.set_stage_delay_us(0);
    stage.stop();
}

#[test]
fn a_give_up_scores_the_rows_in_its_slot_with_the_fallback() {
    // Handed off, a request's rows are only in its job slot: a give-up
    // while the stage holds the slot scores them there with the fallback
    // (here the primary's own model, so the scores must match the stage's).
    let faults = Arc::new(crate::infer::Faults::default());
    let clock = ManualClock::new(crate::deadline::MonotonicClock::new().now_us());
    let mut sh = shared(&dir("stage-give-up-fallback"));
    sh.fallback = Some(sh.registry.snapshot().models[0].clone());
    let config = crate::infer::StageConfig {
        batch_rows_max: 16,
        batch_wait_us_max: 0,
        spin_us: 100,
        jobs_per_shard_max: 4,
        rows_per_job_max: 4,
        row_dim_max: 4,
        core: None,
        shares_core: false,
    };
    let (stage, mut ends) =
        crate::infer::start(config, 1, sh.registry.clone(), BackendKind::F32, faults.clone()).unwrap();
    let mut path = RequestPath::new(sh, &clock).unwrap();
    path.attach_stage(ends.pop().unwrap());
    faults.set_stage_delay_us(50_000);
    let mut s = spec();
    s.budget_us = 1_000_000;
    let mut out = Vec::new();
    assert_eq!(path.handle(&payload(&s), clock.now_ns(), 0, LOCAL, &mut out), Handled::Pending);
    clock.advance_us(1_000_000 - path.policies.ladder.reserve_us);
    let answers = give_ups(&mut path, clock.now_ns());
    assert_eq!(answers.len(), 1);
    let given_up = decode(&answers[0].1);
    assert_eq!((given_up.status, given_up.tier), (Status::Ok, Tier::Fallback), "{given_up:?}");
    // The late result is dropped; the same request scored by the stage
    // answers what the fallback did.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some((_, done, token)) = path.poll_stage() {
            assert!(!path.complete(done, token, &mut out), "a given-up request is not answered twice");
            break;
        }
        assert!(std::time::Instant::now() < until, "the stage never answered");
        std::thread::yield_now();
    }
    faults.set_stage_delay_us(0);
    s.request_id = 2;
    let scored = through_stage(&mut path, &s);
    assert_eq!((scored.status, scored.tier), (Status::Ok, Tier::Primary));
    assert_eq!(scored.scores.len(), given_up.scores.len());
    for (a, b) in scored.scores.iter().zip(&given_up.scores) {
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", scored.scores, given_up.scores);
    }
    stage.stop();
}

#[test]
fn a_completion_routed_to_its_connection_is_not_given_up_on() {
    // Once the poller has routed a completion, the connection answers it:
    // a give-up routed after it would find its slot already answered and
    // released (and perhaps another request's).
    let clock = ManualClock::new(crate::deadline::MonotonicClock::new().now_us());
    let (mut path, stage) = threaded("stage-routed", Arc::default(), &clock);
    let mut s = spec();
    s.budget_us = 1_000_000;
    let mut out = Vec::new();
    assert_eq!(path.handle(&payload(&s), clock.now_ns(), 7, LOCAL, &mut out), Handled::Pending);
    assert_eq!(path.in_flight(), 1);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let (conn, done, token) = loop {
        if let Some(routed) = path.poll_stage() {
            break routed;
        }
        assert!(std::time::Instant::now() < until, "the stage never answered");
        std::thread::yield_now();
    };
    assert_eq!(conn, 7);
    // The stage owes nothing more: the poller may sleep, though the slot is
    // the connection's until it answers.
    assert_eq!(path.in_flight(), 0);
    // Past its give-up time, before its deadline.
    clock.advance_us(1_000_000 - path.policies.ladder.reserve_us / 2);
    assert!(give_ups(&mut path, clock.now_ns()).is_empty(), "its completion was routed first");
    assert!(path.complete(done, token, &mut out));
    let r = decode(&out);
    assert_eq!((r.status, r.tier), (Status::Ok, Tier::Primary));
    stage.stop();
}

#[test]
fn a_give_up_reached_after_the_deadline_answers_deadline_exceeded() {
    // The stage is slow; the shard gets to the give-up only after the
    // deadline (its reactor was held): a static default then would be an
    // `Ok` after the deadline was seen to pass.
    let faults = Arc::new(crate::infer::Faults::default());
    let clock = ManualClock::new(crate::deadline::MonotonicClock::new().now_us());
    let (mut path, stage) = threaded("stage-late-give-up", faults.clone(), &clock);
    faults.set_stage_delay_us(20_000);
    let mut s = spec();
    s.budget_us = 4_000;
    let mut out = Vec::new();
    assert_eq!(path.handle(&payload(&s), clock.now_ns(), 0, LOCAL, &mut out), Handled::Pending);
    clock.advance_us(4_001);
    let mut answers = Vec::new();
    answers.extend(give_ups(&mut path, clock.now_ns()));
    assert_eq!(answers.len(), 1);
    let r = decode(&answers[0].1);
    assert_eq!(r.status, Status::DeadlineExceeded, "{r:?}");
    assert_eq!(r.error, "the deadline passed before a lower rung could answer");
    // In time, the same give-up is the default rung's Ok.
    s.request_id = 2;
    assert_eq!(path.handle(&payload(&s), clock.now_ns(), 0, LOCAL, &mut out), Handled::Pending);
    clock.advance_us(4_000 - path.policies.ladder.reserve_us);
    answers.clear();
    answers.extend(give_ups(&mut path, clock.now_ns()));
    let r = decode(&answers[0].1);
    assert_eq!((r.status, r.tier), (Status::Ok, Tier::Default), "{r:?}");
    faults.set_stage_delay_us(0);
    stage.stop();
}

#[test]
fn a_fallback_that_finishes_late_answers_deadline_exceeded() {
    // The primary is far too slow for the budget, so every request steps
    // down to the fallback model (the same small model); each clock read
    // advances time by `step`, so for some steps the fallback's kernel
    // ends past the deadline. No `Ok` may follow a read past it.
    let mut sh = shared(&dir("late-fallback"));
    let model = sh.registry.snapshot().models[0].clone();
    sh.fallback = Some(model);
    let mut late = 0;
    for step in 1..=400u64 {
        let clock = ManualClock::new(0);
        let mut path = RequestPath::new(sh.clone(), &clock).unwrap();
        path.versions.served[0].kernel_cost.ns_per_row = 1e9;
        path.versions.fallback.as_mut().unwrap().kernel_cost.ns_per_row = 0.0;
        clock.set_step_us(step);
        let mut s = spec();
        s.budget_us = 1_000;
        let read_at = clock.now_us();
        let r = run(&mut path, &s, read_at);
        // The last read inside the request path was one step before this.
        let last_read = clock.now_us() - 2 * step;
        match (r.status, r.tier) {
            (Status::Ok, Tier::Fallback) => {
                assert!(last_read <= read_at + 1_000, "step {step}: Ok at {last_read} past {}", read_at + 1_000)
            }
            (Status::DeadlineExceeded, _) if r.error.contains("fallback model finished after") => late += 1,
            _ => {}
        }
    }
    assert!(late > 0, "some step makes the fallback finish late");
}

/// `shared`'s setup with its model published as "a" under `d/models`, for
/// tests that load versions through a registry directory.
fn models_dir_with_a(d: &std::path::Path) -> (Shared, std::path::PathBuf, Model, crate::registry::Fit) {
    let base = shared(d);
    let models = d.join("models");
    let _ = std::fs::remove_dir_all(&models);
    let mut a = base.registry.snapshot().models[0].as_ref().clone();
    a.name = "a".into();
    crate::registry::publish(&models, &a).unwrap();
    let fit = crate::registry::Fit::user_item(2, 1, 256);
    (base, models, a, fit)
}

#[test]
fn a_version_that_cannot_be_served_leaves_the_served_set_as_it_was() {
    let d = dir("refresh-fail");
    let (base, models, _, fit) = models_dir_with_a(&d);
    let registry = Arc::new(Registry::open(&models, Some("a"), fit, BackendKind::F32, 4).unwrap());
    let mut sh = base.clone();
    sh.registry = registry.clone();
    sh.limits.context_len_max = 1;
    let clock = ManualClock::new(0);
    let mut path = RequestPath::new(sh, &clock).unwrap();
    let ask = |path: &mut RequestPath<&ManualClock>, model: &str| {
        let mut s = spec();
        s.model = model.into();
        s.context.clear();
        run(path, &s, clock.now_us())
    };
    assert_eq!(ask(&mut path, "a").status, Status::Ok);

    // "b" reads 4 context floats: the registry (up to 256) loads it, but
    // this path (up to 1) cannot build it.
    let b = Model {
        name: "b".into(),
        version: 1,
        inputs: vec![
            InputSegment { source: Source::Item, dim: 1 },
            InputSegment { source: Source::Context, dim: 4 },
            InputSegment { source: Source::User, dim: 2 },
        ],
        layers: vec![Layer::quantize(7, 1, false, vec![1.0; 7], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    crate::registry::publish(&models, &b).unwrap();
    registry.load("b", None).unwrap();
    let err = path.refresh_models().unwrap_err();
    assert!(matches!(err, LayoutError::Context { model_dim: 4, limit: 1, .. }), "{err}");
    // Everything that was served still is, and the failed generation is
    // not retried on the next round.
    assert_eq!(ask(&mut path, "a").status, Status::Ok);
    assert_eq!(ask(&mut path, "b").status, Status::ModelNotFound);
    assert!(!path.refresh_models().unwrap());
    assert_eq!(path.versions.served.len(), 1);
    let _ = std::fs::remove_dir_all(&models);
}

/// A tree model over `shared`'s layout: item value (column 0) <= 1 scores
/// logit -1, else 1, plus 0.5.
fn tree_model() -> Model {
    use crate::model::graph::{Graph, Node, Op, OutputKind};
    use crate::model::trees::{Ensemble, Split, TreeNode};
    let mut e = Ensemble { base: 0.5, ..Ensemble::default() };
    let split = Split::Numeric { feature: 0, threshold: 1.0, missing_left: true, zero_missing: false };
    e.push_tree(&[TreeNode { split, left: 1, right: 2 }, TreeNode::leaf(-1.0), TreeNode::leaf(1.0)]);
    let base = shared(&dir("tree-base")).registry.snapshot().models[0].clone();
    Model {
        name: "trees".into(),
        layers: Vec::new(),
        graph: Some(Graph {
            nodes: vec![
                Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 4 },
                Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
            ],
            output: OutputKind::Logit,
        }),
        ..(*base).clone()
    }
}

#[test]
fn trees_and_mlps_serve_as_each_others_fallback() {
    let mlp_scores = [2.0 + 0.5 + 1.0, 0.5 + 0.5 + 1.0, -1.0 + 0.5 + 1.0].map(sigmoid);
    let tree_scores = [1.5, -0.5, -0.5].map(sigmoid);
    let fit = crate::registry::Fit::user_item(2, 1, 256);
    for trees_primary in [true, false] {
        let mut sh = shared(&dir("tree-ladder"));
        let mlp = sh.registry.snapshot().models[0].clone();
        let trees = Arc::new(tree_model());
        let (primary, fallback) = if trees_primary { (trees, mlp) } else { (mlp, trees) };
        sh.registry =
            Arc::new(Registry::from_models(vec![(*primary).clone()], fit.clone(), BackendKind::F32, 4).unwrap());
        sh.fallback = Some(fallback);
        // The cache would answer the second request before the fallback.
        sh.cache.entries_max = 0;
        let clock = ManualClock::new(0);
        let mut path = RequestPath::new(sh, &clock).unwrap();
        let mut s = spec();
        s.model = primary.name.clone();
        let r = run(&mut path, &s, 0);
        assert_eq!((r.status, r.tier), (Status::Ok, Tier::Primary));
        assert_eq!(r.scores, if trees_primary { tree_scores } else { mlp_scores });
        // A primary too slow for the budget steps down to the other kind.
        path.versions.served[0].kernel_cost.ns_per_row = 1e9;
        path.versions.fallback.as_mut().unwrap().kernel_cost.ns_per_row = 0.0;
        let r = run(&mut path, &s, 0);
        assert_eq!((r.status, r.tier, r.reason), (Status::Ok, Tier::Fallback, Reason::Budget), "{trees_primary}");
        assert_eq!(r.scores, if trees_primary { mlp_scores } else { tree_scores });
    }
}

#[test]
fn categorical_ids_in_float_columns_that_match_no_row_count_as_missing() {
    use crate::model::graph::{Graph, Node, Op, OutputKind};
    let mut sh = shared(&dir("float-ids"));
    let base = sh.registry.snapshot().models[0].clone();
    let embedding = |input: usize| Node {
        op: Op::Embedding { dim: 1, rows: 3, table: vec![0.1, 0.2, 0.3].into(), default: vec![0.0] },
        inputs: vec![input],
        width: 1,
    };
    // Column 0 is the item value, column 1 the context float.
    let model = Model {
        name: "ids".into(),
        layers: Vec::new(),
        graph: Some(Graph {
            nodes: vec![
                Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 1 },
                embedding(0),
                Node { op: Op::Input { offset: 1 }, inputs: vec![], width: 1 },
                embedding(2),
                Node { op: Op::Add, inputs: vec![1, 3], width: 1 },
            ],
            output: OutputKind::Logit,
        }),
        ..(*base).clone()
    };
    assert_eq!(model.float_index_columns(), vec![(0, 3), (1, 3)]);
    let fit = crate::registry::Fit::user_item(2, 1, 256);
    sh.registry = Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, 4).unwrap());
    let clock = ManualClock::new(0);
    let mut path = RequestPath::new(sh, &clock).unwrap();
    // Items 10 and 11 hold 2.0 (row 2) and 0.5 (no row): one missing per
    // request from the items; the context adds one unless it names a row.
    for (context, missing, second) in [(1.0, 1, 0.2), (2.5, 2, 0.0), (7.0, 2, 0.0), (-1.0, 2, 0.0)] {
        let s = RequestSpec { model: "ids".into(), item_ids: vec![10, 11], context: vec![context], ..spec() };
        let r = run(&mut path, &s, 0);
        assert_eq!((r.status, r.features_missing), (Status::Ok, missing), "context {context}");
        assert_eq!(r.scores, vec![sigmoid(0.3 + second), sigmoid(second)], "context {context}");
    }
}

#[test]
fn versions_published_through_the_registry_arrive_built_for_each_shard() {
    let d = dir("prebuilt");
    let (base, models, a, fit) = models_dir_with_a(&d);
    let registry = Arc::new(Registry::open(&models, Some("a"), fit, BackendKind::F32, 4).unwrap().with_shards(2));
    let mut sh = base.clone();
    sh.registry = registry.clone();
    let clock = ManualClock::new(0);
    let mut path = RequestPath::new(sh, &clock).unwrap();
    path.set_shard(1);
    // Start-up builds on the shard: nothing was published yet.
    assert_eq!((path.telemetry.counters.backends_prebuilt, path.telemetry.counters.backends_built_on_shard), (0, 1));
    let version = |v: u32| {
        let mut m = a.clone();
        m.version = v;
        m.layers = vec![Layer::quantize(4, 1, false, vec![v as f32; 4], vec![0.0])];
        crate::registry::publish(&models, &m).unwrap();
    };
    let served_version = |path: &mut RequestPath<&ManualClock>| {
        let mut s = spec();
        s.model = "a".into();
        s.context = vec![0.5];
        run(path, &s, clock.now_us()).model_version
    };

    version(5);
    registry.load("a", None).unwrap();
    let v5 = registry.snapshot().models[0].clone();
    assert!(path.refresh_models().unwrap());
    assert_eq!((path.telemetry.counters.backends_prebuilt, path.telemetry.counters.backends_built_on_shard), (1, 1));
    assert_eq!(served_version(&mut path), 5);
    // Shard 1 took its own inbox; shard 0's holds its backend, once.
    assert!(registry.take_inbox(1).is_none());
    let mut inbox = registry.take_inbox(0).expect("shard 0's inbox");
    assert!(inbox.take(&v5).is_some_and(|p| p.ns_per_row >= 0.0));
    assert!(inbox.take(&v5).is_none());

    // What was built for a version replaced before a shard took it is
    // dropped when the shard trims its inbox to what is served.
    version(6);
    registry.load("a", None).unwrap();
    let v6 = registry.snapshot().models[0].clone();
    version(7);
    registry.load("a", None).unwrap();
    inbox.trim(registry.generation());
    assert!(inbox.take(&v6).is_none());

    // A rollback (to 6) is built ahead too.
    assert_eq!(registry.rollback("a").unwrap(), 6);
    assert!(path.refresh_models().unwrap());
    assert_eq!((path.telemetry.counters.backends_prebuilt, path.telemetry.counters.backends_built_on_shard), (2, 1));
    assert_eq!(served_version(&mut path), 6);
    let _ = std::fs::remove_dir_all(&models);
}

#[test]
fn a_swapped_table_is_read_at_the_next_request_and_an_idle_path_lets_the_old_one_go() {
    use crate::features::replica::{ReplicaWriter, Storage};
    let d = dir("swap");
    let mut shared = shared(&d);
    let mut w = ReplicaWriter::create(&d.join("item-w.qrep"), "item", 1, Storage::F32, 4, &[-1.0]).unwrap();
    w.upsert(10, &[2.0]).unwrap();
    w.upsert(11, &[0.5]).unwrap();
    shared.groups[1].handle = w.handle();
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(shared, &clock).unwrap();
    let r = run(&mut path, &spec(), 1_000);
    assert_eq!(r.scores, [2.0 + 0.5 + 1.0, 0.5 + 0.5 + 1.0, -1.0 + 0.5 + 1.0].map(sigmoid));
    assert_eq!(r.features_missing, 1);
    // Growth swaps the table behind the handle; the next request reads the
    // new one, item 12 included.
    for k in 100..200u64 {
        w.upsert(k, &[0.0]).unwrap();
    }
    w.upsert(12, &[3.0]).unwrap();
    let r = run(&mut path, &spec(), 1_000);
    assert_eq!(r.scores, [2.0 + 0.5 + 1.0, 0.5 + 0.5 + 1.0, 3.0 + 0.5 + 1.0].map(sigmoid));
    assert_eq!(r.features_missing, 0);
    // Another swap while the path is idle: it holds the replaced table
    // until its tick refreshes, then the writer can let it go.
    let handle = w.handle();
    let read = Arc::as_ptr(&handle.load());
    let mut k = 200u64;
    while std::ptr::eq(Arc::as_ptr(&handle.load()), read) {
        assert!(k < 1_000_000, "the table grows");
        w.upsert(k, &[0.0]).unwrap();
        k += 1;
    }
    w.reap_retired();
    assert_eq!(w.retired_held(), 1, "the idle path holds the table it last read");
    path.refresh_replicas();
    w.reap_retired();
    assert_eq!(w.retired_held(), 0, "after the tick's refresh nothing holds a replaced table");
}

mod feature_groups;
