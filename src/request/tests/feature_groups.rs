//! Feature groups through the request path: keys of every type and scope,
//! the typed errors, the absent-key policies, and the score cache keyed by
//! every group a model reads.

use super::*;
use crate::features::groups::{Absent, Scope};
use crate::features::replica::{EntityKey, KeyKind};
use crate::model::GroupName;
use crate::wire::GroupKeySpec;

fn group_source(name: &str, scope: Scope) -> Source {
    Source::Group { name: GroupName::new(name).unwrap(), scope }
}

/// The served groups: the legacy pair, and device (string, request), ad
/// (u64, candidate), card (u64, request, rejected when absent), ip (string,
/// request, default when absent) and creative (string, candidate).
fn shared_groups(dir: &std::path::Path) -> Shared {
    let mut base = shared(dir);
    let one = |name: &str, keys: Option<u32>, default: f32, rows: &[(&str, f32)]| {
        let mut b = ReplicaBuilder::new(name, 1);
        if let Some(bytes) = keys {
            b = b.str_keys(bytes).unwrap();
        }
        b.set_default(&[default]).unwrap();
        for (k, v) in rows {
            match keys {
                Some(_) => b.push_str(k.as_bytes(), &[*v]).unwrap(),
                None => b.push(k.parse().unwrap(), &[*v]).unwrap(),
            }
        }
        let path = dir.join(format!("{name}.qrep"));
        b.write(&path).unwrap();
        Arc::new(ReplicaHandle::open(&path, name).unwrap())
    };
    let group = |name: &str, scope, absent, handle| SharedGroup {
        name: name.into(),
        scope,
        absent,
        handle,
        child: None,
        ttl_s: 0,
        nulls_missing: false,
    };
    base.groups.extend([
        group(
            "device",
            Scope::Request,
            Absent::Reject,
            one("device", Some(16), 0.0, &[("f7a9c2", 3.0), ("abc", -2.0)]),
        ),
        group("ad", Scope::Candidate, Absent::Reject, one("ad", None, -1.0, &[("100", 1.0), ("101", 0.5)])),
        group("card", Scope::Request, Absent::Reject, one("card", None, 0.0, &[("7", 0.25), ("8", -0.25)])),
        group("ip", Scope::Request, Absent::Default, one("ip", Some(40), 0.75, &[("203.0.113.7", 1.5)])),
        group("creative", Scope::Candidate, Absent::Reject, one("creative", Some(8), 0.0, &[("c1", 0.125)])),
    ]);
    let model = Model {
        name: "fraud".into(),
        version: 2,
        inputs: ["device", "ad", "card", "ip", "creative"]
            .iter()
            .map(|&g| {
                let scope = if g == "ad" || g == "creative" { Scope::Candidate } else { Scope::Request };
                InputSegment { source: group_source(g, scope), dim: 1 }
            })
            .chain([InputSegment { source: Source::Context, dim: 1 }])
            .collect(),
        // logit = device + ad + card + ip + creative + context
        layers: vec![Layer::quantize(6, 1, false, vec![1.0; 6], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    let fit = crate::registry::Fit { groups: base.group_fits(), context_len_max: 256 };
    base.registry = Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, 4).unwrap());
    base
}

fn ids(v: &[u64]) -> GroupKeySpec {
    GroupKeySpec::Ids(v.to_vec())
}

fn strs(v: &[&str]) -> GroupKeySpec {
    GroupKeySpec::Strs(v.iter().map(|s| s.to_string()).collect())
}

/// Two candidates (ads 100 and 101; creatives c1 and the unknown c2) for
/// card 7 on device f7a9c2, no ip.
fn fraud() -> RequestSpec {
    RequestSpec {
        request_id: 5,
        budget_us: 1_000,
        context: vec![0.5],
        groups: vec![
            ("device".into(), strs(&["f7a9c2"])),
            ("ad".into(), ids(&[100, 101])),
            ("card".into(), ids(&[7])),
            ("creative".into(), strs(&["c1", "c2"])),
        ],
        ..RequestSpec::default()
    }
}

fn with_group(mut s: RequestSpec, name: &str, keys: GroupKeySpec) -> RequestSpec {
    s.groups.retain(|(g, _)| g != name);
    s.groups.push((name.into(), keys));
    s
}

#[test]
fn every_group_is_looked_up_by_its_own_keys() {
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(shared_groups(&dir("groups")), &clock).unwrap();
    let r = run(&mut path, &fraud(), 1_000);
    assert_eq!((r.status, r.error.as_str()), (Status::Ok, ""));
    // ip is absent (its default, 0.75, counted missing); c2 is unknown.
    assert_eq!(r.scores, [3.0 + 1.0 + 0.25 + 0.75 + 0.125 + 0.5, 3.0 + 0.5 + 0.25 + 0.75 + 0.0 + 0.5].map(sigmoid));
    assert_eq!(r.features_missing, 2);

    let r = run(&mut path, &with_group(fraud(), "ip", strs(&["203.0.113.7"])), 1_000);
    assert_eq!(r.scores[1], sigmoid(3.0 + 0.5 + 0.25 + 1.5 + 0.0 + 0.5));
    assert_eq!(r.features_missing, 1);
    let r = run(&mut path, &with_group(fraud(), "device", strs(&["unknown-device"])), 1_000);
    assert_eq!(r.scores[1], sigmoid(0.5 + 0.25 + 0.75 + 0.5));
    assert_eq!(r.features_missing, 3);
    // item_ids, when sent, count the candidates; the groups must agree.
    let mut s = fraud();
    s.item_ids = vec![1, 2];
    assert_eq!(run(&mut path, &s, 1_000).status, Status::Ok);
}

#[test]
fn bad_keys_get_bad_request_naming_the_group() {
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(shared_groups(&dir("group-errors")), &clock).unwrap();
    let mut three_items = fraud();
    three_items.item_ids = vec![1, 2, 3];
    let mut no_card = fraud();
    no_card.groups.retain(|(g, _)| g != "card");
    let mut twice = fraud();
    twice.groups.push(("device".into(), strs(&["abc"])));
    for (s, want) in [
        (with_group(fraud(), "nope", ids(&[1])), "unknown feature group 'nope'"),
        (with_group(fraud(), "device", ids(&[1])), "group 'device' is keyed by strings, the request sends u64 ids"),
        (with_group(fraud(), "card", strs(&["7"])), "group 'card' is keyed by u64 ids, the request sends string keys"),
        (with_group(fraud(), "device", strs(&["0123456789abcdef0"])), "a key of 17 bytes; keys are 1 to 16 bytes"),
        (with_group(fraud(), "device", strs(&[""])), "a key of 0 bytes"),
        (with_group(fraud(), "card", ids(&[7, 8])), "group 'card' takes one key per request, the request sends 2"),
        (three_items, "group 'ad' takes one key per candidate: 2 keys for 3 candidates"),
        (no_card, "the model reads feature group 'card', and the request carries no key for it"),
        (twice, "feature group 'device' is named twice"),
    ] {
        let r = run(&mut path, &s, 1_000);
        assert_eq!(r.status, Status::BadRequest, "{s:?}");
        assert!(r.error.contains(want), "{:?} does not say {want:?}", r.error);
        assert!(r.scores.is_empty());
    }
    // The path is unharmed.
    assert_eq!(run(&mut path, &fraud(), 1_000).status, Status::Ok);
}

#[test]
fn the_score_cache_is_keyed_by_every_group_the_model_reads() {
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(shared_groups(&dir("group-cache")), &clock).unwrap();
    path.policies.cache_before_primary = true;
    let first = run(&mut path, &fraud(), 1_000);
    assert_eq!(first.tier, Tier::Primary);
    assert_eq!(run(&mut path, &fraud(), 1_000).tier, Tier::Cached, "the same keys are cached");
    // Another key in any one group is another entry, never the cached score.
    for other in [
        with_group(fraud(), "device", strs(&["abc"])),
        with_group(fraud(), "card", ids(&[8])),
        with_group(fraud(), "ip", strs(&["203.0.113.7"])),
        with_group(fraud(), "creative", strs(&["c2", "c1"])),
        with_group(fraud(), "ad", ids(&[100, 102])),
    ] {
        let r = run(&mut path, &other, 1_000);
        assert_eq!((r.status, r.tier), (Status::Ok, Tier::Primary), "{other:?}");
        assert_ne!(r.scores, first.scores, "{other:?}");
    }
}

#[test]
fn a_request_without_candidates_or_item_ids_scores_one_row() {
    let clock = ManualClock::new(1_000);
    let mut sh = shared_groups(&dir("group-one-row"));
    let model = Model {
        name: "card-only".into(),
        version: 1,
        inputs: vec![
            InputSegment { source: group_source("card", Scope::Request), dim: 1 },
            InputSegment { source: group_source("device", Scope::Request), dim: 1 },
        ],
        layers: vec![Layer::quantize(2, 1, false, vec![1.0, 1.0], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    let fit = crate::registry::Fit { groups: sh.group_fits(), context_len_max: 256 };
    sh.registry = Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, 4).unwrap());
    let mut path = RequestPath::new(sh, &clock).unwrap();
    let s = RequestSpec {
        groups: vec![("card".into(), ids(&[8])), ("device".into(), strs(&["abc"]))],
        ..RequestSpec::default()
    };
    let r = run(&mut path, &s, 1_000);
    assert_eq!((r.status, r.scores.as_slice()), (Status::Ok, [sigmoid(-0.25 - 2.0)].as_slice()));
}

#[test]
fn a_model_reading_a_group_the_server_lacks_or_at_another_scope_is_refused() {
    let sh = shared_groups(&dir("group-layout"));
    for (source, want) in [
        (group_source("merchant", Scope::Request), "reads feature group 'merchant', which this server does not serve"),
        (
            group_source("card", Scope::Candidate),
            "reads group 'card' once per candidate, the server keys it once per request",
        ),
    ] {
        let model = Model {
            name: "x".into(),
            version: 1,
            inputs: vec![InputSegment { source, dim: 1 }],
            layers: vec![Layer::quantize(1, 1, false, vec![1.0], vec![0.0])],
            calibration: None,
            graph: None,
            onnx: None,
            feature_names: Vec::new(),
        };
        let fit = crate::registry::Fit { groups: sh.group_fits(), context_len_max: 256 };
        let e = Registry::from_models(vec![model], fit, BackendKind::F32, 4).expect_err("refused");
        assert!(e.to_string().contains(want), "{e}");
    }
}

#[test]
fn the_canary_is_sticky_by_the_key_of_canary_group() {
    let d = dir("group-canary");
    let mut sh = shared_groups(&d);
    let model = sh.registry.snapshot().models[0].clone();
    let models = d.join("models");
    for version in [1, 2] {
        crate::registry::publish(&models, &Model { version, ..(*model).clone() }).unwrap();
    }
    let fit = crate::registry::Fit { groups: sh.group_fits(), context_len_max: 256 };
    let registry = Registry::open(&models, None, fit, BackendKind::F32, 4).unwrap();
    assert_eq!(registry.canary("fraud", Some(1), 0.5).unwrap(), Some(1));
    sh.registry = Arc::new(registry);
    sh.canary_group = "card".into();
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(sh, &clock).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for card in 0..64u64 {
        // The same card on other devices and users: one side, always.
        let versions: std::collections::BTreeSet<u32> = ["f7a9c2", "abc", "other"]
            .iter()
            .enumerate()
            .map(|(i, device)| {
                let mut s = with_group(with_group(fraud(), "card", ids(&[card])), "device", strs(&[device]));
                s.user_id = i as u64;
                let r = run(&mut path, &s, 1_000);
                assert_eq!(r.status, Status::Ok, "{}", r.error);
                r.model_version
            })
            .collect();
        assert_eq!(versions.len(), 1, "card {card} was served by versions {versions:?}");
        seen.extend(versions);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), [1, 2], "half the cards on the canary");
}

#[test]
fn input_drift_follows_the_context_and_the_request_scope_groups() {
    use crate::model::{ActivationScales, Calibration, ScoreHistogram};
    let mut sh = shared_groups(&dir("group-drift"));
    let mut model = (*sh.registry.snapshot().models[0]).clone();
    // Inputs: device, ad@candidate, card, ip, creative@candidate, context.
    // Followed, in order: context, then device, card, ip, then ad, creative.
    assert_eq!(model.drift_columns(), [(5, 1), (0, 1), (2, 1), (3, 1), (1, 1), (4, 1)]);
    assert_eq!(model.drift_request_segments(), 4);
    model.calibration = Some(Calibration {
        method: "max-abs".into(),
        rows: 100,
        input_ranges: vec![8.0],
        scores: ScoreHistogram { edges: vec![0.0, 0.5, 1.0], counts: vec![50, 50] },
        input_means: vec![0.0, 1.0, 0.0, 0.0, 0.5, 0.0],
        input_variances: vec![1.0; 6],
        activations: ActivationScales::Dynamic,
        static_error: None,
        dynamic_error: None,
    });
    let fit = crate::registry::Fit { groups: sh.group_fits(), context_len_max: 256 };
    sh.registry = Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, 4).unwrap());
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(sh, &clock).unwrap();
    // Two candidates; context 0.5; device 3.0; card 0.25; ip absent (0.75).
    assert_eq!(run(&mut path, &fraud(), 1_000).status, Status::Ok);
    let interval = path.versions.served[0].drift.as_mut().expect("calibrated").take();
    assert_eq!(interval.rows, 2);
    // Σ rows × (x − μ): context 0.5, device 3 − 1, card 0.25, ip 0.75; the
    // first request (count 1) samples the second candidate: ad 101 (0.5 −
    // 0.5), creative c2 (unknown: 0).
    assert_eq!(interval.sum, [1.0, 4.0, 0.5, 1.5, 0.0, 0.0]);
    // The next samples the first: ad 100 (1 − 0.5), creative c1 (0.125).
    assert_eq!(run(&mut path, &fraud(), 1_000).status, Status::Ok);
    let interval = path.versions.served[0].drift.as_mut().expect("calibrated").take();
    assert_eq!(interval.sum, [1.0, 4.0, 0.5, 1.5, 1.0, 0.25]);
}

/// An auction's groups: `ad` (u64, candidate) links to `campaign`
/// (string keys), which links to `advertiser` (u64); `publisher` (u64,
/// request) links to `network` (u64). Each row is one float; the model sums
/// the columns it reads, weighted so each group's share shows.
fn auction_groups(dir: &std::path::Path, inputs: &[(&str, Scope)]) -> Shared {
    let mut base = shared(dir);
    base.limits.candidates_max = 8;
    let build = |name: &str, keys: KeyKind, link: Option<KeyKind>, rows: &[(&str, f32, Option<&str>)]| {
        let mut b = ReplicaBuilder::new(name, 1);
        if let KeyKind::Str { bytes_max } = keys {
            b = b.str_keys(bytes_max).unwrap();
        }
        if let Some(kind) = link {
            b = b.links_to(kind).unwrap();
        }
        b.set_default(&[-100.0]).unwrap();
        let key_of = |k: &'static str, kind| match kind {
            KeyKind::U64 => EntityKey::Id(k.parse().unwrap()),
            KeyKind::Str { .. } => EntityKey::Str(k.as_bytes()),
        };
        for &(k, v, parent) in rows {
            let k: &'static str = Box::leak(k.to_string().into_boxed_str());
            let parent = parent.map(|p| key_of(Box::leak(p.to_string().into_boxed_str()), link.unwrap()));
            b.push_linked(key_of(k, keys), &[v], parent).unwrap();
        }
        let path = dir.join(format!("{name}.qrep"));
        b.write(&path).unwrap();
        Arc::new(ReplicaHandle::open(&path, name).unwrap())
    };
    let campaigns = KeyKind::Str { bytes_max: 16 };
    let group = |name: &str, scope, handle, child: Option<&str>| SharedGroup {
        name: name.into(),
        scope,
        absent: Absent::Reject,
        handle,
        child: child.map(Into::into),
        ttl_s: 0,
        nulls_missing: false,
    };
    base.groups.extend([
        group(
            "ad",
            Scope::Candidate,
            build(
                "ad",
                KeyKind::U64,
                Some(campaigns),
                &[("1", 1.0, Some("spring")), ("2", 2.0, Some("autumn")), ("3", 3.0, None), ("4", 4.0, Some("gone"))],
            ),
            None,
        ),
        group(
            "campaign",
            Scope::Candidate,
            build(
                "campaign",
                campaigns,
                Some(KeyKind::U64),
                &[("spring", 10.0, Some("77")), ("autumn", 20.0, Some("78"))],
            ),
            Some("ad"),
        ),
        group(
            "advertiser",
            Scope::Candidate,
            build("advertiser", KeyKind::U64, None, &[("77", 100.0, None)]),
            Some("campaign"),
        ),
        group(
            "publisher",
            Scope::Request,
            build(
                "publisher",
                KeyKind::U64,
                Some(KeyKind::U64),
                &[("5", 1000.0, Some("9")), ("6", 2000.0, Some("10"))],
            ),
            None,
        ),
        group(
            "network",
            Scope::Request,
            build("network", KeyKind::U64, None, &[("9", 10000.0, None)]),
            Some("publisher"),
        ),
    ]);
    let model = Model {
        name: "auction".into(),
        version: 1,
        inputs: inputs.iter().map(|&(g, scope)| InputSegment { source: group_source(g, scope), dim: 1 }).collect(),
        // Scaled down so the sum stays where the sigmoid can be inverted.
        layers: vec![Layer::quantize(inputs.len(), 1, false, vec![1e-4; inputs.len()], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    let fit = crate::registry::Fit { groups: base.group_fits(), context_len_max: 256 };
    base.registry = Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, 8).unwrap());
    base
}

fn auction(ads: &[u64], publisher: u64) -> RequestSpec {
    RequestSpec {
        request_id: 9,
        budget_us: 1_000,
        groups: vec![("ad".into(), ids(ads)), ("publisher".into(), ids(&[publisher]))],
        ..RequestSpec::default()
    }
}

/// The sums of the columns a request's rows held (the model's output is
/// the sigmoid of 1e-4 times the sum).
fn logits(r: &wire::Response) -> Vec<f32> {
    r.scores.iter().map(|&p| (p / (1.0 - p)).ln() * 1e4).collect()
}

#[test]
fn parents_are_joined_through_each_rows_link_and_a_missing_parent_is_a_counted_default() {
    use Scope::{Candidate as C, Request as R};
    let inputs = [("advertiser", C), ("ad", C), ("network", R), ("campaign", C), ("publisher", R)];
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(auction_groups(&dir("chains"), &inputs), &clock).unwrap();
    // Ads 1 and 2 reach their campaigns; only spring's advertiser is there.
    // Ad 3 names no campaign, ad 4 one that is not there, ad 5 is unknown:
    // each missing link down the chain reads that group's default (-100).
    let r = run(&mut path, &auction(&[1, 2, 3, 4, 5], 5), 1_000);
    assert_eq!((r.status, r.error.as_str()), (Status::Ok, ""));
    let request = 1000.0 + 10000.0;
    let want = [
        request + 1.0 + 10.0 + 100.0,
        request + 2.0 + 20.0 - 100.0,
        request + 3.0 - 100.0 - 100.0,
        request + 4.0 - 100.0 - 100.0,
        request - 100.0 - 100.0 - 100.0,
    ];
    for (got, want) in logits(&r).iter().zip(want) {
        assert!((got - want).abs() < 0.5, "{:?} against {want:?}", logits(&r));
    }
    // autumn's advertiser; ad 3's campaign and advertiser; ad 4's two; ad 5's three.
    assert_eq!(r.features_missing, 1 + 2 + 2 + 3);
    // A request-scope chain: publisher 6 links to a network that is not there.
    let r = run(&mut path, &auction(&[1], 6), 1_000);
    assert!((logits(&r)[0] - (2000.0 - 100.0 + 1.0 + 10.0 + 100.0)).abs() < 0.5, "{:?}", logits(&r));
    assert_eq!(r.features_missing, 1);
}

#[test]
fn a_model_reading_only_the_far_end_of_a_chain_is_keyed_through_every_link() {
    let clock = ManualClock::new(1_000);
    let shared = auction_groups(&dir("chain-end"), &[("advertiser", Scope::Candidate)]);
    let mut path = RequestPath::new(shared, &clock).unwrap();
    let s = RequestSpec { groups: vec![("ad".into(), ids(&[1, 2]))], ..auction(&[], 0) };
    let r = run(&mut path, &s, 1_000);
    assert_eq!((r.status, r.error.as_str()), (Status::Ok, ""));
    assert_eq!(logits(&r).iter().map(|l| l.round()).collect::<Vec<_>>(), [100.0, -100.0]);
    assert_eq!(r.features_missing, 1);
    // The chain's root is keyed by the request, so a request without it is refused.
    let r = run(&mut path, &RequestSpec { groups: vec![("publisher".into(), ids(&[5]))], ..s.clone() }, 1_000);
    assert_eq!(r.status, Status::BadRequest);
    assert!(r.error.contains("the model reads feature group 'ad'"), "{}", r.error);
}

#[test]
fn a_request_naming_a_group_keyed_through_links_gets_bad_request() {
    let clock = ManualClock::new(1_000);
    let inputs = [("ad", Scope::Candidate), ("campaign", Scope::Candidate)];
    let mut path = RequestPath::new(auction_groups(&dir("chain-errors"), &inputs), &clock).unwrap();
    let mut s = auction(&[1, 2], 5);
    s.groups.push(("campaign".into(), strs(&["spring", "autumn"])));
    let r = run(&mut path, &s, 1_000);
    assert_eq!(r.status, Status::BadRequest);
    assert_eq!(
        r.error,
        "feature group 'campaign' is keyed through the links in 'ad''s rows; a request does not carry its keys"
    );
}

/// Feast views with a `ttl`: a row whose event time (its link words) is
/// older is served as missing, NaN into the model and counted, at request
/// scope and per candidate; a row without a time is served as it is; a row
/// with a null feature counts as missing too.
#[test]
fn a_feast_row_past_its_ttl_is_served_as_missing() {
    use crate::features::feast::rows::{row_time_link, ROW_TIME_LINK};
    let d = dir("feast-ttl");
    let mut base = shared(&d);
    let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let (fresh, old) = (now_s - 60, now_s - 7_200);
    let timed = |name: &str, rows: &[(u64, i64)]| {
        let mut b = ReplicaBuilder::new(name, 1).links_to(ROW_TIME_LINK).unwrap();
        b.set_default(&[f32::NAN]).unwrap();
        for &(k, ts) in rows {
            // Key 4's one feature is null in Feast.
            let value = if k == 4 { f32::NAN } else { 1.0 };
            b.push_linked(EntityKey::Id(k), &[value], row_time_link(ts)).unwrap();
        }
        let path = d.join(format!("{name}.qrep"));
        b.write(&path).unwrap();
        Arc::new(ReplicaHandle::open(&path, name).unwrap())
    };
    let group = |name: &str, scope, handle| SharedGroup {
        name: name.into(),
        scope,
        absent: Absent::Reject,
        handle,
        child: None,
        ttl_s: 3_600,
        nulls_missing: true,
    };
    base.groups.extend([
        group("recent", Scope::Request, timed("recent", &[(1, fresh), (2, old), (3, 0), (4, fresh)])),
        group("seen", Scope::Candidate, timed("seen", &[(10, fresh), (11, old)])),
    ]);
    let model = Model {
        name: "fraud".into(),
        version: 2,
        inputs: vec![
            InputSegment { source: group_source("recent", Scope::Request), dim: 1 },
            InputSegment { source: group_source("seen", Scope::Candidate), dim: 1 },
        ],
        layers: vec![Layer::quantize(2, 1, false, vec![1.0; 2], vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    };
    let fit = crate::registry::Fit { groups: base.group_fits(), context_len_max: 256 };
    base.registry = Arc::new(Registry::from_models(vec![model], fit, BackendKind::F32, 4).unwrap());
    let clock = ManualClock::new(1_000);
    let mut path = RequestPath::new(base, &clock).unwrap();
    let spec = |recent: u64| RequestSpec {
        request_id: 9,
        budget_us: 1_000,
        groups: vec![("recent".into(), ids(&[recent])), ("seen".into(), ids(&[10, 11]))],
        ..RequestSpec::default()
    };
    let r = run(&mut path, &spec(1), 1_000);
    assert_eq!(r.status, Status::Ok, "{}", r.error);
    assert_eq!(r.scores[0], sigmoid(2.0));
    assert_eq!(r.features_missing, 1, "candidate 11 is past the ttl");
    let r = run(&mut path, &spec(2), 1_000);
    assert_eq!(r.features_missing, 2, "the request's row and candidate 11");
    // A row with no time is not judged by it.
    assert_eq!(run(&mut path, &spec(3), 1_000).features_missing, 1);
    // A null inside a fresh row: NaN into the model (read as 0), counted
    // as missing like an absent row.
    let r = run(&mut path, &spec(4), 1_000);
    assert_eq!(r.scores[0], sigmoid(1.0));
    assert_eq!(r.features_missing, 2, "the request's null and candidate 11");
}
