//! The protocol's golden vectors (`schemas/vectors/`): request and response
//! frames as bytes, beside their meaning in JSON, for every client to check
//! itself against (docs/PROTOCOL.md, "Golden vectors").
//!
//! Why a test: the vectors are produced by this crate's own encoders, so
//! they can only drift from the server by someone changing an encoder or the
//! schema. This test encodes every case again and fails if a `.bin` or a
//! `.json` differs from what is checked in; it also decodes every `.bin`
//! with the server's decoders and checks the meaning against the `.json`,
//! so a vector can't say one thing and hold another. `QUIVER_BLESS=1`
//! rewrites the folder after an intended change.

use std::path::{Path, PathBuf};

use quiver::wire::{
    self, fb, ExplainFields, ExplainSkipped, GroupKeySpec, Reason, RequestEncoder, RequestLimits, RequestSpec,
    ResponseEncoder, ResponseFields, Status, Tier,
};
use serde_json::{json, Value};

/// One vector: a file stem and its frames, in stream order.
struct Vector {
    name: &'static str,
    what: &'static str,
    frames: Frames,
}

enum Frames {
    Requests(Vec<RequestSpec>),
    Responses(Vec<Owned>),
}

/// A `ResponseFields` with owned scores and error, for building cases.
struct Owned {
    request_id: u64,
    status: Status,
    scores: Vec<f32>,
    tier: Tier,
    model_version: u32,
    server_us: u32,
    features_missing: u16,
    error: &'static str,
    reason: Reason,
    features_stale: bool,
    explain: OwnedExplain,
}

/// `ExplainFields`, owned.
#[derive(Default)]
struct OwnedExplain {
    skipped: ExplainSkipped,
    bias: f64,
    candidates: Vec<u32>,
    features: Vec<u32>,
    contributions: Vec<f64>,
}

impl Owned {
    fn ok(request_id: u64, scores: &[f32]) -> Owned {
        Owned {
            request_id,
            status: Status::Ok,
            scores: scores.to_vec(),
            tier: Tier::Primary,
            model_version: 3,
            server_us: 41,
            features_missing: 0,
            error: "",
            reason: Reason::None,
            features_stale: false,
            explain: OwnedExplain::default(),
        }
    }

    fn failure(request_id: u64, status: Status, error: &'static str) -> Owned {
        let f = ResponseFields::failure(request_id, status, error);
        Owned {
            request_id,
            status,
            scores: Vec::new(),
            tier: f.tier,
            model_version: f.model_version,
            server_us: f.server_us,
            features_missing: f.features_missing,
            error,
            reason: f.reason,
            features_stale: f.features_stale,
            explain: OwnedExplain::default(),
        }
    }

    fn fields(&self) -> ResponseFields<'_> {
        ResponseFields {
            request_id: self.request_id,
            status: self.status,
            scores: &self.scores,
            tier: self.tier,
            model_version: self.model_version,
            server_us: self.server_us,
            features_missing: self.features_missing,
            error: self.error,
            reason: self.reason,
            features_stale: self.features_stale,
            explain: ExplainFields {
                skipped: self.explain.skipped,
                bias: self.explain.bias,
                candidates: &self.explain.candidates,
                features: &self.explain.features,
                contributions: &self.explain.contributions,
            },
        }
    }
}

fn request(request_id: u64, items: &[u64]) -> RequestSpec {
    RequestSpec { request_id, item_ids: items.to_vec(), ..RequestSpec::default() }
}

fn strs(keys: &[&str]) -> GroupKeySpec {
    GroupKeySpec::Strs(keys.iter().map(|k| k.to_string()).collect())
}

fn vectors() -> Vec<Vector> {
    let full = RequestSpec {
        request_id: u64::MAX,
        model: "auction".into(),
        budget_us: 2500,
        priority: 3,
        client_id: 42,
        user_id: (1 << 63) + 5,
        item_ids: vec![1, 2, u64::MAX],
        context: vec![0.5, -1.25, 3.0e-8, 1.0e30],
        context_ids: vec![0, 9],
        groups: vec![
            ("device".into(), strs(&["f7a9c2"])),
            ("ad".into(), GroupKeySpec::Ids(vec![10, 20, 30])),
            ("ip".into(), strs(&["203.0.113.7"])),
        ],
        // Appended later than the clients' first release: at their
        // defaults here, so every client's encoder still writes this frame.
        explain_top_k: 0,
        explain_candidates_max: 0,
        rows: Vec::new(),
        row_count: 0,
    };
    let explain = RequestSpec {
        request_id: 21,
        model: "fraud".into(),
        budget_us: 5000,
        item_ids: vec![3, 1, 4, 1, 5],
        context: vec![250.0, 3.0],
        explain_top_k: 5,
        explain_candidates_max: 3,
        ..RequestSpec::default()
    };
    let groups_only = RequestSpec {
        request_id: 7,
        groups: vec![
            ("card".into(), GroupKeySpec::Ids(vec![4_111_111_111])),
            ("merchant".into(), strs(&["m-1", "m-2"])),
        ],
        ..RequestSpec::default()
    };
    let before_groups = RequestSpec {
        request_id: 2,
        user_id: 77,
        item_ids: vec![5, 6],
        context: vec![1.0, 0.0, -0.5],
        ..RequestSpec::default()
    };
    let stale = Owned {
        features_stale: true,
        features_missing: 2,
        tier: Tier::Cached,
        reason: Reason::Budget,
        ..Owned::ok(12, &[0.125, 0.75])
    };
    let fallback = Owned { tier: Tier::Fallback, reason: Reason::BreakerOpen, ..Owned::ok(13, &[0.5]) };
    let model_error = Owned { tier: Tier::Fallback, reason: Reason::ModelError, ..Owned::ok(14, &[0.25]) };
    let default =
        Owned { tier: Tier::Default, reason: Reason::Overload, model_version: 0, ..Owned::ok(15, &[0.01, 0.01, 0.01]) };
    // Candidates 0 and 2 of three explained, two features each, largest
    // |contribution| first; bias + every contribution is each margin.
    let explained = Owned {
        explain: OwnedExplain {
            skipped: ExplainSkipped::None,
            bias: -2.5,
            candidates: vec![0, 2],
            features: vec![7, 1, 3, 7],
            contributions: vec![1.25, -0.5, -0.75, 0.375],
        },
        ..Owned::ok(16, &[0.25, 0.125, 0.5])
    };
    let explain_skips = [
        (17, ExplainSkipped::Budget, Tier::Primary, Reason::None),
        (18, ExplainSkipped::NotExplainable, Tier::Primary, Reason::None),
        (19, ExplainSkipped::LowerRung, Tier::Fallback, Reason::Budget),
        (20, ExplainSkipped::Unavailable, Tier::Primary, Reason::None),
    ]
    .map(|(id, skipped, tier, reason)| Owned {
        tier,
        reason,
        explain: OwnedExplain { skipped, ..OwnedExplain::default() },
        ..Owned::ok(id, &[0.5])
    });
    vec![
        Vector {
            name: "request_minimal",
            what: "the smallest request a server scores: one candidate, every other field at its default (absent)",
            frames: Frames::Requests(vec![request(1, &[7])]),
        },
        Vector {
            name: "request_full",
            what: "every request field present (but the explanation fields, at their defaults), u64 fields at their \
                   extremes, u64 and string group keys",
            frames: Frames::Requests(vec![full]),
        },
        Vector {
            name: "request_groups_only",
            what: "no item_ids: the candidate count is the longest group key list (2)",
            frames: Frames::Requests(vec![groups_only]),
        },
        Vector {
            name: "request_before_groups",
            what: "a frame as clients encoded it before feature groups (no groups field): still valid",
            frames: Frames::Requests(vec![before_groups]),
        },
        Vector {
            name: "request_no_candidates",
            what: "item_ids present but empty and no groups: an empty vector, which the server refuses (BadRequest)",
            frames: Frames::Requests(vec![request(9, &[])]),
        },
        Vector {
            name: "request_explain",
            what: "reason codes asked for: explain_top_k 5 of the explain_candidates_max 3 highest-scored of five \
                   candidates (docs/PROTOCOL.md, \"Explanations\")",
            frames: Frames::Requests(vec![explain]),
        },
        Vector {
            name: "response_ok",
            what: "a primary answer: one score per candidate, the appended fields (reason, features_stale) absent",
            frames: Frames::Responses(vec![Owned::ok(1, &[0.25, 0.5, 0.999_023_4])]),
        },
        Vector {
            name: "response_cached_stale",
            what: "a lower rung with its reason, features missing and stale: the appended fields present",
            frames: Frames::Responses(vec![stale]),
        },
        Vector {
            name: "response_tiers",
            what: "the fallback model (breaker open, model error) and the default score (overload)",
            frames: Frames::Responses(vec![fallback, model_error, default]),
        },
        Vector {
            name: "response_explained",
            what: "reason codes (explain_top_k 2, explain_candidates_max 2): the explained candidates, the bias, \
                   k (feature, contribution) pairs per candidate",
            frames: Frames::Responses(vec![explained]),
        },
        Vector {
            name: "response_explain_skipped",
            what: "explanations asked for and skipped: for the budget, a model that cannot be explained, a lower \
                   rung, a version swapped out",
            frames: Frames::Responses(explain_skips.into()),
        },
        Vector {
            name: "response_statuses",
            what: "every status but Ok, as the server answers a request it did not score: no scores, an error line",
            frames: Frames::Responses(vec![
                Owned::failure(21, Status::DeadlineExceeded, "the budget ran out before the lookups"),
                Owned::failure(22, Status::Overloaded, "shed: priority 0 below the shard's floor"),
                Owned::failure(23, Status::RateLimited, "client 42 over its rate"),
                Owned::failure(24, Status::BadRequest, "context has 3 floats, the model takes 16"),
                Owned::failure(25, Status::ModelNotFound, "no model named \"ranker\""),
                Owned::failure(26, Status::Internal, "the inference thread is gone"),
            ]),
        },
        Vector {
            name: "pipelined_requests",
            what: "three requests sent back to back on one connection without waiting",
            frames: Frames::Requests(vec![request(101, &[1]), request(102, &[2]), request(103, &[3])]),
        },
        Vector {
            name: "pipelined_responses",
            what: "their responses as they may arrive: out of order, matched to requests by request_id",
            frames: Frames::Responses(vec![
                Owned::ok(103, &[0.3]),
                Owned::ok(101, &[0.1]),
                Owned::failure(102, Status::DeadlineExceeded, "the budget ran out in the queue"),
            ]),
        },
    ]
}

/// A u64 as JSON writes it here: a decimal string (JSON readers that hold
/// numbers as doubles, JavaScript's, lose integers past 2^53).
fn u64_json(v: u64) -> Value {
    Value::String(v.to_string())
}

/// An f32 as the shortest decimal that reads back as the same f32.
fn f32_json(v: f32) -> Value {
    serde_json::from_str(&format!("{v:?}")).expect("a finite float")
}

fn ids_json(v: Option<flatbuffers::Vector<'_, u64>>) -> Value {
    v.map_or(Value::Null, |v| v.iter().map(u64_json).collect())
}

fn floats_json(v: Option<flatbuffers::Vector<'_, f32>>) -> Value {
    v.map_or(Value::Null, |v| v.iter().map(f32_json).collect())
}

/// A request frame's meaning, read from its bytes: absent fields are
/// `null`, present ones their value, so absent and empty differ.
fn request_meaning(payload: &[u8]) -> Value {
    let r = flatbuffers::root::<fb::ScoreRequest>(payload).expect("a request vector verifies");
    let groups = r.groups().map_or(Value::Null, |groups| {
        groups
            .iter()
            .map(|g| {
                let keys = g.keys().map_or(Value::Null, |k| k.iter().map(|s| Value::String(s.into())).collect());
                json!({"group": g.group(), "ids": ids_json(g.ids()), "keys": keys})
            })
            .collect()
    });
    let limits = RequestLimits { frame_bytes_max: 1 << 20, candidates_max: 256, context_len_max: 64 };
    let server = match wire::decode_request(payload, &limits) {
        Ok(r) => format!("accepted: {} candidates", r.candidates),
        Err(e) => format!("refused (BadRequest): {e}"),
    };
    json!({
        "request_id": u64_json(r.request_id()),
        "model": r.model(),
        "budget_us": r.budget_us(),
        "priority": r.priority(),
        "client_id": r.client_id(),
        "user_id": u64_json(r.user_id()),
        "item_ids": ids_json(r.item_ids()),
        "context": floats_json(r.context()),
        "context_ids": ids_json(r.context_ids()),
        "groups": groups,
        "explain_top_k": r.explain_top_k(),
        "explain_candidates_max": r.explain_candidates_max(),
        "server": server,
    })
}

fn response_meaning(payload: &[u8]) -> Value {
    let r = flatbuffers::root::<fb::ScoreResponse>(payload).expect("a response vector verifies");
    let decoded = wire::decode_response(payload, 256).expect("the client decoder reads it");
    assert_eq!(decoded.request_id, r.request_id());
    let e = &decoded.explanations;
    let top: Vec<Value> = e
        .iter()
        .map(|(c, top)| json!({"candidate": c, "top": top.map(|(f, v)| json!([f, v])).collect::<Vec<_>>()}))
        .collect();
    json!({
        "request_id": u64_json(r.request_id()),
        "status": r.status().variant_name(),
        "scores": floats_json(r.scores()),
        "tier": r.tier().variant_name(),
        "model_version": r.model_version(),
        "server_us": r.server_us(),
        "features_missing": r.features_missing(),
        "error": r.error(),
        "reason": r.reason().variant_name(),
        "features_stale": r.features_stale(),
        "explain_skipped": r.explain_skipped().variant_name(),
        "explain_bias": r.explain_bias(),
        "explain_candidates": r.explain_candidates().map_or(Value::Null, |v| v.iter().collect()),
        "explain_features": r.explain_features().map_or(Value::Null, |v| v.iter().collect()),
        "explain_contributions": r.explain_contributions().map_or(Value::Null, |v| v.iter().collect()),
        "explanations": top,
    })
}

/// The frames of `bytes`, each without its length prefix.
fn split(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let (payload, used) = wire::split_frame(bytes, 1 << 20).expect("a whole frame").expect("no partial frame");
        out.push(payload);
        bytes = &bytes[used..];
    }
    out
}

/// The bytes and the JSON of one vector, from the encoders.
fn render(v: &Vector) -> (Vec<u8>, String) {
    let mut bytes = Vec::new();
    let kind = match &v.frames {
        Frames::Requests(specs) => {
            let mut enc = RequestEncoder::new();
            specs.iter().for_each(|s| enc.encode(s, &mut bytes));
            "requests"
        }
        Frames::Responses(all) => {
            let mut enc = ResponseEncoder::new(256);
            all.iter().for_each(|o| enc.encode(&o.fields(), &mut bytes));
            "responses"
        }
    };
    let frames: Vec<Value> = split(&bytes)
        .into_iter()
        .map(|payload| {
            let meaning = if kind == "requests" { request_meaning(payload) } else { response_meaning(payload) };
            json!({"bytes": payload.len() + wire::FRAME_PREFIX_BYTES, "meaning": meaning})
        })
        .collect();
    let doc = json!({"what": v.what, "kind": kind, "frames": frames});
    (bytes, serde_json::to_string_pretty(&doc).unwrap() + "\n")
}

fn folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/vectors")
}

#[test]
fn the_golden_vectors_are_what_the_encoders_write_and_decode_to_their_json() {
    let dir = folder();
    let bless = std::env::var("QUIVER_BLESS").is_ok_and(|v| v == "1");
    let all = vectors();
    if bless {
        std::fs::create_dir_all(&dir).unwrap();
    }
    let mut stale = Vec::new();
    for v in &all {
        let (bytes, text) = render(v);
        let (bin, json_path) = (dir.join(format!("{}.bin", v.name)), dir.join(format!("{}.json", v.name)));
        if bless {
            std::fs::write(&bin, &bytes).unwrap();
            std::fs::write(&json_path, &text).unwrap();
        }
        if std::fs::read(&bin).ok().as_deref() != Some(&bytes[..])
            || std::fs::read_to_string(&json_path).ok().as_deref() != Some(&text[..])
        {
            stale.push(v.name);
        }
    }
    assert!(
        stale.is_empty(),
        "schemas/vectors differs from what the encoders write for {stale:?}; after an intended change rewrite \
         it with:\n  QUIVER_BLESS=1 cargo test --release --test protocol_vectors"
    );
    // Nothing in the folder that no case writes (a vector left behind by a
    // renamed case would be checked by clients and by no one here).
    let mut known: Vec<String> =
        all.iter().flat_map(|v| [format!("{}.bin", v.name), format!("{}.json", v.name)]).collect();
    known.push("README.md".into());
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(known.contains(&name), "schemas/vectors/{name} is written by no case in tests/protocol_vectors.rs");
    }
    every_vector_decodes_to_its_json(&dir, &all);
}

/// The checked-in bytes, read back with the server's and the client's
/// decoders, mean what their JSON says (independently of the encoders).
/// Called after any blessing, never beside it.
fn every_vector_decodes_to_its_json(dir: &Path, all: &[Vector]) {
    for v in all {
        let bytes = std::fs::read(dir.join(format!("{}.bin", v.name))).unwrap();
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{}.json", v.name))).unwrap()).unwrap();
        let frames = split(&bytes);
        let want = doc["frames"].as_array().unwrap();
        assert_eq!(frames.len(), want.len(), "{}: frame count", v.name);
        for (i, (payload, w)) in frames.iter().zip(want).enumerate() {
            let meaning = match doc["kind"].as_str() {
                Some("requests") => request_meaning(payload),
                Some("responses") => response_meaning(payload),
                other => panic!("{}: unknown kind {other:?}", v.name),
            };
            assert_eq!(meaning, w["meaning"], "{} frame {i}", v.name);
            assert_eq!(w["bytes"].as_u64(), Some((payload.len() + wire::FRAME_PREFIX_BYTES) as u64));
        }
    }
}

/// Floats in the JSON read back as the very f32 the frame holds.
#[test]
fn float_text_round_trips_exactly() {
    for v in [0.999_023_4f32, 3.0e-8, 1.0e30, -1.25, 0.1, f32::MIN_POSITIVE, f32::MAX] {
        let back: f64 = serde_json::from_value(f32_json(v)).unwrap();
        assert_eq!(back as f32, v);
    }
}
