//! The wire protocol: length-prefixed FlatBuffers frames (`schemas/quiver.fbs`).
//!
//! A frame is a u32 little-endian length followed by that many bytes of one
//! FlatBuffer. This module splits frames out of a byte stream, verifies every
//! request with explicit limits before any field is read, and encodes
//! responses into a reusable builder so the hot path does not allocate.
//! It knows nothing about sockets: the shard and the client feed it bytes.

// flatc's output, checked in; the server's `tests/generated.rs` fails when
// it differs from what the pinned flatc writes from schemas/quiver.fbs.
#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, mismatched_lifetime_syntaxes, deprecated)]
#[rustfmt::skip]
#[path = "quiver_generated.rs"]
mod generated;

pub use fb::{ExplainSkipped, Reason, Status, Tier};
pub use generated::quiver::wire as fb;

use flatbuffers::{FlatBufferBuilder, VerifierOptions};

/// Bytes of the length prefix in front of every frame.
pub const FRAME_PREFIX_BYTES: usize = 4;

/// Why a byte stream could not be split into frames. The stream cannot be
/// resynchronised after any of these, so the connection is closed.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameError {
    TooLarge { len_bytes: usize, frame_bytes_max: usize },
    Empty,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooLarge { len_bytes, frame_bytes_max } => {
                write!(f, "frame length {len_bytes} exceeds the limit of {frame_bytes_max} bytes")
            }
            FrameError::Empty => f.write_str("empty frame (length prefix 0)"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Splits the first complete frame off `buf`.
///
/// Returns the frame's payload and the number of bytes it occupies including
/// its prefix, or `None` when more bytes are needed.
pub fn split_frame(buf: &[u8], frame_bytes_max: usize) -> Result<Option<(&[u8], usize)>, FrameError> {
    let Some(prefix) = buf.get(..FRAME_PREFIX_BYTES) else {
        return Ok(None);
    };
    let len_bytes = u32::from_le_bytes(prefix.try_into().expect("slice of 4")) as usize;
    if len_bytes == 0 {
        return Err(FrameError::Empty);
    }
    if len_bytes > frame_bytes_max {
        return Err(FrameError::TooLarge { len_bytes, frame_bytes_max });
    }
    let end = FRAME_PREFIX_BYTES + len_bytes;
    Ok(buf.get(FRAME_PREFIX_BYTES..end).map(|payload| (payload, end)))
}

/// Appends `payload` to `out` as one frame.
pub fn push_frame(out: &mut Vec<u8>, payload: &[u8]) {
    let len = u32::try_from(payload.len()).expect("frames are far below 4 GiB");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(payload);
}

/// Why a frame's payload is not an acceptable request. The frame boundary is
/// intact, so the connection answers `BadRequest` and keeps going.
#[derive(Debug, PartialEq)]
pub enum DecodeError {
    Invalid(flatbuffers::InvalidFlatbuffer),
    TooManyCandidates {
        count: usize,
        candidates_max: usize,
    },
    NoCandidates,
    ContextTooLong {
        count: usize,
        context_len_max: usize,
    },
    ContextIdsTooLong {
        count: usize,
        context_len_max: usize,
    },
    TooManyGroups {
        count: usize,
        groups_max: usize,
    },
    UnnamedGroup {
        at: usize,
    },
    TooManyKeys {
        group: String,
        count: usize,
        candidates_max: usize,
    },
    ExplainTopK {
        top_k: usize,
        top_k_max: usize,
    },
    ExplainCandidates {
        count: usize,
        explained_max: usize,
    },
    /// `rows` beside keys or context, which raw rows replace.
    RowsWithKeys {
        field: &'static str,
    },
    /// `rows` and `row_count` disagree: no rows, a count of 0, or a float
    /// count that is not a whole number of rows.
    RowCount {
        row_count: usize,
        floats: usize,
    },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Invalid(e) => write!(f, "request failed FlatBuffers verification: {e}"),
            DecodeError::TooManyCandidates { count, candidates_max } => {
                write!(f, "{count} candidates exceed the limit of {candidates_max}")
            }
            DecodeError::NoCandidates => f.write_str("request has no candidates"),
            DecodeError::ContextTooLong { count, context_len_max } => {
                write!(f, "{count} context floats exceed the limit of {context_len_max}")
            }
            DecodeError::ContextIdsTooLong { count, context_len_max } => {
                write!(f, "{count} context ids exceed the limit of {context_len_max}")
            }
            DecodeError::TooManyGroups { count, groups_max } => {
                write!(f, "{count} feature groups exceed the limit of {groups_max}")
            }
            DecodeError::UnnamedGroup { at } => write!(f, "group entry {at} names no group"),
            DecodeError::TooManyKeys { group, count, candidates_max } => {
                write!(f, "group '{group}' carries {count} keys, above the limit of {candidates_max} candidates")
            }
            DecodeError::ExplainTopK { top_k, top_k_max } => {
                write!(f, "explain_top_k {top_k} exceeds the limit of {top_k_max} (EXPLAIN_TOP_K_MAX)")
            }
            DecodeError::ExplainCandidates { count, explained_max } => write!(
                f,
                "{count} candidates to explain exceed the limit of {explained_max} (EXPLAIN_CANDIDATES_MAX): \
                 set explain_candidates_max"
            ),
            DecodeError::RowsWithKeys { field } => {
                write!(f, "a request with raw rows carries no {field}: the rows are the model's whole input")
            }
            DecodeError::RowCount { row_count, floats } => {
                write!(f, "raw rows: {floats} floats in `rows` are not {row_count} whole rows (row_count)")
            }
        }
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DecodeError::Invalid(e) => Some(e),
            _ => None,
        }
    }
}

impl From<flatbuffers::InvalidFlatbuffer> for DecodeError {
    fn from(e: flatbuffers::InvalidFlatbuffer) -> DecodeError {
        DecodeError::Invalid(e)
    }
}

/// Most `groups` entries one request may carry: the server's own bound on
/// feature groups (`features::groups::GROUPS_MAX`).
pub const REQUEST_GROUPS_MAX: usize = 16;

/// Most features one explained candidate's answer lists (`explain_top_k`).
pub const EXPLAIN_TOP_K_MAX: usize = 32;

/// Most candidates one request has explained: all of them
/// (`explain_candidates_max` 0) or the top `explain_candidates_max` by score.
pub const EXPLAIN_CANDIDATES_MAX: usize = 64;

/// Most bytes the explanations add to a response frame: per explained
/// candidate its index and `EXPLAIN_TOP_K_MAX` (u32, f64) pairs, plus the
/// bias, the enum and the four vectors' lengths and offsets.
pub const EXPLANATIONS_BYTES_MAX: usize = 64 + EXPLAIN_CANDIDATES_MAX * (4 + EXPLAIN_TOP_K_MAX * 12);

/// Most bytes of a response frame to a request of up to `candidates_max`
/// candidates (docs/PROTOCOL.md, "Connections"): scores, the error line,
/// the fixed fields, and explanations when the request asks for them.
pub fn response_bytes_max(candidates_max: usize) -> usize {
    1024 + candidates_max * 4 + EXPLANATIONS_BYTES_MAX
}

/// Limits a request must satisfy before the server looks at it.
#[derive(Clone, Copy, Debug)]
pub struct RequestLimits {
    pub frame_bytes_max: usize,
    pub candidates_max: usize,
    pub context_len_max: usize,
}

impl RequestLimits {
    fn verifier_options(&self) -> VerifierOptions {
        VerifierOptions {
            // ScoreRequest, its `groups` vector, a GroupKeys table, its
            // `keys` vector and a string: nothing nests deeper.
            max_depth: 6,
            max_tables: 4 + REQUEST_GROUPS_MAX,
            max_apparent_size: self.frame_bytes_max,
            ignore_missing_null_terminator: false,
        }
    }
}

/// A verified request whose sizes are within limits. Fields are read lazily
/// from the frame bytes; nothing is copied.
pub struct Request<'buf> {
    pub raw: fb::ScoreRequest<'buf>,
    /// Rows to score: `item_ids`' length, else the longest key list of
    /// `groups`, else 1 when `groups` is present (see `schemas/quiver.fbs`).
    pub candidates: usize,
}

impl<'buf> Request<'buf> {
    pub fn request_id(&self) -> u64 {
        self.raw.request_id()
    }
    pub fn budget_us(&self) -> u32 {
        self.raw.budget_us()
    }
    pub fn user_id(&self) -> u64 {
        self.raw.user_id()
    }
    pub fn model(&self) -> &'buf str {
        self.raw.model().unwrap_or("")
    }
    pub fn item_ids(&self) -> flatbuffers::Vector<'buf, u64> {
        self.raw.item_ids().unwrap_or_default()
    }
    pub fn context(&self) -> flatbuffers::Vector<'buf, f32> {
        self.raw.context().unwrap_or_default()
    }
    pub fn context_ids(&self) -> flatbuffers::Vector<'buf, u64> {
        self.raw.context_ids().unwrap_or_default()
    }
    /// The feature groups' keys the request carries, at most
    /// [`REQUEST_GROUPS_MAX`], each named.
    pub fn groups(&self) -> flatbuffers::Vector<'buf, flatbuffers::ForwardsUOffset<fb::GroupKeys<'buf>>> {
        self.raw.groups().unwrap_or_default()
    }
    /// The raw rows, when the caller sent the model's input rows itself:
    /// `candidates` rows of equal width, checked by `decode_request`; the
    /// request then carries no keys and no context.
    pub fn rows(&self) -> Option<flatbuffers::Vector<'buf, f32>> {
        self.raw.rows()
    }
    /// Features to list per explained candidate; 0 explains nothing.
    pub fn explain_top_k(&self) -> usize {
        usize::from(self.raw.explain_top_k())
    }
    /// How many candidates are explained when `explain_top_k` is set: the
    /// top `explain_candidates_max` by score, or all (0); within
    /// [`EXPLAIN_CANDIDATES_MAX`] (checked by `decode_request`).
    pub fn explained(&self) -> usize {
        match usize::from(self.raw.explain_candidates_max()) {
            0 => self.candidates,
            m => m.min(self.candidates),
        }
    }
}

/// How many keys a group entry carries, u64 or string.
pub fn key_count(keys: &fb::GroupKeys<'_>) -> usize {
    keys.ids().map_or(0, |v| v.len()) + keys.keys().map_or(0, |v| v.len())
}

/// Verifies `payload` and checks it against `limits`.
pub fn decode_request<'buf>(payload: &'buf [u8], limits: &RequestLimits) -> Result<Request<'buf>, DecodeError> {
    let raw = flatbuffers::root_with_opts::<fb::ScoreRequest>(&limits.verifier_options(), payload)?;
    if raw.rows().is_some() || raw.row_count() > 0 {
        return decode_raw_rows(raw, limits);
    }
    let mut count = raw.item_ids().map_or(0, |v| v.len());
    if count > limits.candidates_max {
        return Err(DecodeError::TooManyCandidates { count, candidates_max: limits.candidates_max });
    }
    if let Some(groups) = raw.groups() {
        if groups.len() > REQUEST_GROUPS_MAX {
            return Err(DecodeError::TooManyGroups { count: groups.len(), groups_max: REQUEST_GROUPS_MAX });
        }
        let mut longest = 1;
        for (at, g) in groups.iter().enumerate() {
            let group = g.group().ok_or(DecodeError::UnnamedGroup { at })?;
            let keys = key_count(&g);
            if keys > limits.candidates_max {
                let candidates_max = limits.candidates_max;
                return Err(DecodeError::TooManyKeys { group: group.into(), count: keys, candidates_max });
            }
            longest = longest.max(keys);
        }
        if count == 0 {
            count = longest;
        }
    }
    if count == 0 {
        return Err(DecodeError::NoCandidates);
    }
    let context_len = raw.context().map_or(0, |v| v.len());
    if context_len > limits.context_len_max {
        return Err(DecodeError::ContextTooLong { count: context_len, context_len_max: limits.context_len_max });
    }
    let ids = raw.context_ids().map_or(0, |v| v.len());
    if ids > limits.context_len_max {
        return Err(DecodeError::ContextIdsTooLong { count: ids, context_len_max: limits.context_len_max });
    }
    check_explain(Request { raw, candidates: count })
}

/// A request with raw rows: nothing to look up, so keys and context are
/// refused rather than ignored; `row_count` rows within the candidate limit.
fn decode_raw_rows<'buf>(raw: fb::ScoreRequest<'buf>, limits: &RequestLimits) -> Result<Request<'buf>, DecodeError> {
    let keyed = [
        ("user_id", raw.user_id() != 0),
        ("item_ids", raw.item_ids().is_some()),
        ("context", raw.context().is_some()),
        ("context_ids", raw.context_ids().is_some()),
        ("groups", raw.groups().is_some()),
    ];
    if let Some((field, _)) = keyed.iter().find(|(_, present)| *present) {
        return Err(DecodeError::RowsWithKeys { field });
    }
    let row_count = raw.row_count() as usize;
    let floats = raw.rows().map_or(0, |v| v.len());
    if row_count > limits.candidates_max {
        return Err(DecodeError::TooManyCandidates { count: row_count, candidates_max: limits.candidates_max });
    }
    if row_count == 0 || floats == 0 || !floats.is_multiple_of(row_count) {
        return Err(DecodeError::RowCount { row_count, floats });
    }
    check_explain(Request { raw, candidates: row_count })
}

/// The explanation fields' bounds, common to keyed and raw requests.
fn check_explain(request: Request<'_>) -> Result<Request<'_>, DecodeError> {
    let raw = request.raw;
    let top_k = request.explain_top_k();
    if top_k > EXPLAIN_TOP_K_MAX {
        return Err(DecodeError::ExplainTopK { top_k, top_k_max: EXPLAIN_TOP_K_MAX });
    }
    let asked = usize::from(raw.explain_candidates_max());
    if top_k > 0 && (asked > EXPLAIN_CANDIDATES_MAX || request.explained() > EXPLAIN_CANDIDATES_MAX) {
        let count = if asked > 0 { asked } else { request.explained() };
        return Err(DecodeError::ExplainCandidates { count, explained_max: EXPLAIN_CANDIDATES_MAX });
    }
    Ok(request)
}

/// Verifies `payload` as a `ScoreRequest` (every offset and length checked
/// against its bytes, at most `frame_bytes_max` of them) without checking
/// its sizes against `limits`: a request refused for too many candidates,
/// groups or keys, or a context too long, can still be read safely, each
/// field within the frame (what the decision log records of a refusal).
/// Tables are bounded by what the frame's bytes can hold, not by
/// [`REQUEST_GROUPS_MAX`], so a request with too many groups verifies too.
pub fn verify_request<'buf>(
    payload: &'buf [u8],
    limits: &RequestLimits,
) -> Result<fb::ScoreRequest<'buf>, flatbuffers::InvalidFlatbuffer> {
    // A table takes at least its 4-byte offset to its vtable.
    let opts = VerifierOptions { max_tables: limits.frame_bytes_max / 4 + 1, ..limits.verifier_options() };
    flatbuffers::root_with_opts::<fb::ScoreRequest>(&opts, payload)
}

/// Reads the request_id of a payload that failed validation, if the bytes are
/// a well-formed request at all, so the error response can carry it.
pub fn salvage_request_id(payload: &[u8], limits: &RequestLimits) -> u64 {
    flatbuffers::root_with_opts::<fb::ScoreRequest>(&limits.verifier_options(), payload).map_or(0, |r| r.request_id())
}

/// Everything a response carries, borrowed from the request path's buffers.
#[derive(Clone, Copy, Debug)]
pub struct ResponseFields<'a> {
    pub request_id: u64,
    pub status: Status,
    pub scores: &'a [f32],
    pub tier: Tier,
    pub model_version: u32,
    pub server_us: u32,
    pub features_missing: u16,
    pub error: &'a str,
    pub reason: Reason,
    /// Features have not been confirmed current for longer than the bound.
    pub features_stale: bool,
    /// Reason codes, when asked for.
    pub explain: ExplainFields<'a>,
}

/// The explanations a response carries (`explain_*` on the wire),
/// borrowed: `features` and `contributions` hold `k` entries per entry of
/// `candidates`, each candidate's by descending |contribution|.
#[derive(Clone, Copy, Debug)]
pub struct ExplainFields<'a> {
    pub skipped: ExplainSkipped,
    pub bias: f64,
    pub candidates: &'a [u32],
    pub features: &'a [u32],
    pub contributions: &'a [f64],
}

impl ExplainFields<'_> {
    /// No explanation: none asked for (or `skipped` says why none came).
    pub const NONE: ExplainFields<'static> =
        ExplainFields { skipped: ExplainSkipped::None, bias: 0.0, candidates: &[], features: &[], contributions: &[] };
}

impl ResponseFields<'_> {
    /// A response with no scores for a request that failed before scoring.
    pub fn failure(request_id: u64, status: Status, error: &str) -> ResponseFields<'_> {
        ResponseFields {
            request_id,
            status,
            scores: &[],
            tier: Tier::Default,
            model_version: 0,
            server_us: 0,
            features_missing: 0,
            error,
            reason: Reason::None,
            features_stale: false,
            explain: ExplainFields::NONE,
        }
    }
}

/// Longest `error` string a response carries, in bytes.
pub const ERROR_BYTES_MAX: usize = 160;

/// `error` as the protocol documents it: one line of printable ASCII, runs
/// of whitespace and control characters (FlatBuffers verifier messages
/// carry newlines and tabs) as one space, other characters as `?`, at most
/// `ERROR_BYTES_MAX` bytes. Written into `buf`, so nothing is allocated.
fn one_line<'b>(error: &str, buf: &'b mut [u8; ERROR_BYTES_MAX]) -> &'b str {
    let mut n = 0;
    let mut space = false;
    for c in error.trim().chars() {
        if n == ERROR_BYTES_MAX {
            break;
        }
        if c.is_whitespace() || c.is_control() {
            space = true;
            continue;
        }
        if space && n + 1 < ERROR_BYTES_MAX {
            buf[n] = b' ';
            n += 1;
        }
        space = false;
        buf[n] = if c.is_ascii_graphic() { c as u8 } else { b'?' };
        n += 1;
    }
    std::str::from_utf8(&buf[..n]).expect("printable ASCII only")
}

/// Encodes responses into frames, reusing one builder (no allocation once warm).
pub struct ResponseEncoder {
    builder: FlatBufferBuilder<'static>,
}

impl ResponseEncoder {
    /// `scores_max` sizes the builder so steady-state encoding never grows it,
    /// explanations included.
    pub fn new(scores_max: usize) -> ResponseEncoder {
        ResponseEncoder { builder: FlatBufferBuilder::with_capacity(response_bytes_max(scores_max)) }
    }

    /// Appends one response frame to `out`.
    pub fn encode(&mut self, fields: &ResponseFields<'_>, out: &mut Vec<u8>) {
        let b = &mut self.builder;
        b.reset();
        let scores = (!fields.scores.is_empty()).then(|| b.create_vector(fields.scores));
        let mut line = [0u8; ERROR_BYTES_MAX];
        let error = (!fields.error.is_empty()).then(|| b.create_string(one_line(fields.error, &mut line)));
        let ex = &fields.explain;
        let explained = !ex.candidates.is_empty();
        let explain_candidates = explained.then(|| b.create_vector(ex.candidates));
        let explain_features = explained.then(|| b.create_vector(ex.features));
        let explain_contributions = explained.then(|| b.create_vector(ex.contributions));
        let root = fb::ScoreResponse::create(
            b,
            &fb::ScoreResponseArgs {
                request_id: fields.request_id,
                status: fields.status,
                scores,
                tier: fields.tier,
                model_version: fields.model_version,
                server_us: fields.server_us,
                features_missing: fields.features_missing,
                error,
                reason: fields.reason,
                features_stale: fields.features_stale,
                explain_candidates,
                explain_bias: if explained { ex.bias } else { 0.0 },
                explain_features,
                explain_contributions,
                explain_skipped: ex.skipped,
            },
        );
        b.finish_minimal(root);
        push_frame(out, b.finished_data());
    }
}

/// What a client sends: an owned request, easy to build in tests and tools.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestSpec {
    pub request_id: u64,
    pub model: String,
    pub budget_us: u32,
    pub priority: u8,
    pub client_id: u32,
    pub user_id: u64,
    pub item_ids: Vec<u64>,
    pub context: Vec<f32>,
    pub context_ids: Vec<u64>,
    /// Keys of feature groups, by group name (`groups` on the wire).
    pub groups: Vec<(String, GroupKeySpec)>,
    /// Reason codes: features per explained candidate (0: none), and how
    /// many of the top-scored candidates to explain (0: all).
    pub explain_top_k: u16,
    pub explain_candidates_max: u16,
    /// Raw rows (`rows` and `row_count` on the wire): the model's input
    /// rows, `row_count` of them one after another, scored as sent. Empty
    /// for a keyed request; a raw one leaves the keys and context empty.
    pub rows: Vec<f32>,
    pub row_count: u32,
}

/// One group's keys in a [`RequestSpec`]: one for a request-scope group,
/// one per candidate for a candidate-scope group.
#[derive(Clone, Debug, PartialEq)]
pub enum GroupKeySpec {
    Ids(Vec<u64>),
    Strs(Vec<String>),
}

/// Encodes requests into frames, reusing one builder.
pub struct RequestEncoder {
    builder: FlatBufferBuilder<'static>,
}

impl Default for RequestEncoder {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestEncoder {
    pub fn new() -> RequestEncoder {
        RequestEncoder { builder: FlatBufferBuilder::with_capacity(1024) }
    }

    /// Appends one request frame to `out`.
    pub fn encode(&mut self, spec: &RequestSpec, out: &mut Vec<u8>) {
        let b = &mut self.builder;
        b.reset();
        let model = (!spec.model.is_empty()).then(|| b.create_string(&spec.model));
        let raw = !spec.rows.is_empty() || spec.row_count > 0;
        let item_ids =
            (!spec.item_ids.is_empty() || (spec.groups.is_empty() && !raw)).then(|| b.create_vector(&spec.item_ids));
        let context = (!spec.context.is_empty()).then(|| b.create_vector(&spec.context));
        let context_ids = (!spec.context_ids.is_empty()).then(|| b.create_vector(&spec.context_ids));
        let groups = (!spec.groups.is_empty()).then(|| {
            let entries: Vec<_> = spec
                .groups
                .iter()
                .map(|(name, keys)| {
                    let group = Some(b.create_string(name));
                    let (ids, keys) = match keys {
                        GroupKeySpec::Ids(ids) => (Some(b.create_vector(ids)), None),
                        GroupKeySpec::Strs(strs) => {
                            let strs: Vec<_> = strs.iter().map(|k| b.create_string(k)).collect();
                            (None, Some(b.create_vector(&strs)))
                        }
                    };
                    fb::GroupKeys::create(b, &fb::GroupKeysArgs { group, ids, keys })
                })
                .collect();
            b.create_vector(&entries)
        });
        let rows = raw.then(|| b.create_vector(&spec.rows));
        let root = fb::ScoreRequest::create(
            b,
            &fb::ScoreRequestArgs {
                request_id: spec.request_id,
                model,
                budget_us: spec.budget_us,
                priority: spec.priority,
                client_id: spec.client_id,
                user_id: spec.user_id,
                item_ids,
                context,
                context_ids,
                groups,
                explain_top_k: spec.explain_top_k,
                explain_candidates_max: spec.explain_candidates_max,
                rows,
                row_count: spec.row_count,
            },
        );
        b.finish_minimal(root);
        push_frame(out, b.finished_data());
    }
}

/// A decoded response, owned.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    pub request_id: u64,
    pub status: Status,
    pub scores: Vec<f32>,
    pub tier: Tier,
    pub model_version: u32,
    pub server_us: u32,
    pub features_missing: u16,
    pub error: String,
    pub reason: Reason,
    pub features_stale: bool,
    /// Reason codes, when the request asked for them.
    pub explanations: Explanations,
}

/// A response's reason codes, owned (`explain_*` on the wire).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Explanations {
    /// Why there are none although the request asked (`None` otherwise).
    pub skipped: ExplainSkipped,
    /// The margin with no feature known; each candidate's margin is the
    /// bias plus all its contributions.
    pub bias: f64,
    /// The explained candidates' indices in request order.
    pub candidates: Vec<u32>,
    /// `k` (feature index, contribution) pairs per explained candidate,
    /// concatenated in `candidates` order.
    pub features: Vec<u32>,
    pub contributions: Vec<f64>,
}

impl Explanations {
    /// Features listed per explained candidate.
    pub fn k(&self) -> usize {
        self.features.len().checked_div(self.candidates.len()).unwrap_or(0)
    }

    /// Each explained candidate with its (feature index, contribution)
    /// pairs, largest |contribution| first.
    pub fn iter(&self) -> impl Iterator<Item = (usize, impl Iterator<Item = (u32, f64)> + '_)> + '_ {
        let k = self.k();
        self.candidates.iter().enumerate().map(move |(at, &c)| {
            let span = at * k..(at + 1) * k;
            (c as usize, self.features[span.clone()].iter().copied().zip(self.contributions[span].iter().copied()))
        })
    }
}

/// Verifies and copies out one response payload.
pub fn decode_response(payload: &[u8], scores_max: usize) -> Result<Response, flatbuffers::InvalidFlatbuffer> {
    let opts = VerifierOptions {
        max_depth: 4,
        max_tables: 8,
        max_apparent_size: response_bytes_max(scores_max),
        ignore_missing_null_terminator: false,
    };
    let r = flatbuffers::root_with_opts::<fb::ScoreResponse>(&opts, payload)?;
    let candidates: Vec<u32> = r.explain_candidates().map(|v| v.iter().collect()).unwrap_or_default();
    let features: Vec<u32> = r.explain_features().map(|v| v.iter().collect()).unwrap_or_default();
    let contributions: Vec<f64> = r.explain_contributions().map(|v| v.iter().collect()).unwrap_or_default();
    // k pairs per candidate, or none: a response that says otherwise is
    // read as carrying no explanation rather than misattributing one.
    let whole = !candidates.is_empty()
        && features.len() == contributions.len()
        && features.len().is_multiple_of(candidates.len());
    let explanations = if whole {
        Explanations { skipped: r.explain_skipped(), bias: r.explain_bias(), candidates, features, contributions }
    } else {
        Explanations { skipped: r.explain_skipped(), ..Explanations::default() }
    };
    Ok(Response {
        request_id: r.request_id(),
        status: r.status(),
        scores: r.scores().map(|v| v.iter().collect()).unwrap_or_default(),
        tier: r.tier(),
        model_version: r.model_version(),
        server_us: r.server_us(),
        features_missing: r.features_missing(),
        error: r.error().unwrap_or("").to_string(),
        reason: r.reason(),
        features_stale: r.features_stale(),
        explanations,
    })
}

/// Short lowercase name of a status, for logs, the CLI and JSON output.
pub fn status_name(status: Status) -> &'static str {
    match status {
        Status::Ok => "ok",
        Status::DeadlineExceeded => "deadline_exceeded",
        Status::Overloaded => "overloaded",
        Status::RateLimited => "rate_limited",
        Status::BadRequest => "bad_request",
        Status::ModelNotFound => "model_not_found",
        Status::Internal => "internal",
        _ => "unknown",
    }
}

/// Short lowercase name of a step-down reason.
pub fn reason_name(reason: Reason) -> &'static str {
    match reason {
        Reason::None => "none",
        Reason::Budget => "budget",
        Reason::BreakerOpen => "breaker_open",
        Reason::Overload => "overload",
        Reason::ModelError => "model_error",
        _ => "unknown",
    }
}

/// Short lowercase name of why explanations were skipped.
pub fn explain_skipped_name(skipped: ExplainSkipped) -> &'static str {
    match skipped {
        ExplainSkipped::None => "none",
        ExplainSkipped::Budget => "budget",
        ExplainSkipped::NotExplainable => "not_explainable",
        ExplainSkipped::LowerRung => "lower_rung",
        ExplainSkipped::Unavailable => "unavailable",
        _ => "unknown",
    }
}

/// Short lowercase name of a tier.
pub fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Primary => "primary",
        Tier::Cached => "cached",
        Tier::Fallback => "fallback",
        Tier::Default => "default",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: RequestLimits = RequestLimits { frame_bytes_max: 65_536, candidates_max: 64, context_len_max: 16 };

    fn spec(items: usize) -> RequestSpec {
        RequestSpec {
            request_id: 7,
            model: "m".into(),
            budget_us: 900,
            priority: 2,
            client_id: 3,
            user_id: 42,
            item_ids: (0..items as u64).collect(),
            context: vec![0.5, -1.0],
            context_ids: vec![3, 1 << 40],
            groups: Vec::new(),
            explain_top_k: 0,
            explain_candidates_max: 0,
            rows: Vec::new(),
            row_count: 0,
        }
    }

    fn encoded(spec: &RequestSpec) -> Vec<u8> {
        let mut out = Vec::new();
        RequestEncoder::new().encode(spec, &mut out);
        out.split_off(FRAME_PREFIX_BYTES)
    }

    #[test]
    fn raw_rows_round_trip_and_count_the_candidates() {
        let rows: Vec<f32> = vec![0.5, -1.0, f32::NAN, 2.0, 0.0, -0.0];
        let spec = RequestSpec { request_id: 5, rows: rows.clone(), row_count: 3, ..RequestSpec::default() };
        let payload = encoded(&spec);
        let r = decode_request(&payload, &LIMITS).unwrap();
        assert_eq!(r.candidates, 3);
        let got: Vec<u32> = r.rows().unwrap().iter().map(f32::to_bits).collect();
        assert_eq!(got, rows.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // A raw request sends no item_ids, not even an empty vector.
        assert!(r.raw.item_ids().is_none());
    }

    #[test]
    fn raw_rows_refuse_keys_context_and_bad_counts() {
        let raw = |f: fn(&mut RequestSpec)| {
            let mut s = RequestSpec { rows: vec![1.0; 6], row_count: 2, ..RequestSpec::default() };
            f(&mut s);
            decode_request(&encoded(&s), &LIMITS).err()
        };
        assert_eq!(raw(|_| ()), None);
        assert_eq!(raw(|s| s.user_id = 4), Some(DecodeError::RowsWithKeys { field: "user_id" }));
        assert_eq!(raw(|s| s.item_ids = vec![1, 2]), Some(DecodeError::RowsWithKeys { field: "item_ids" }));
        assert_eq!(raw(|s| s.context = vec![1.0]), Some(DecodeError::RowsWithKeys { field: "context" }));
        assert_eq!(raw(|s| s.context_ids = vec![1]), Some(DecodeError::RowsWithKeys { field: "context_ids" }));
        let group = |s: &mut RequestSpec| s.groups = vec![("card".into(), GroupKeySpec::Ids(vec![1]))];
        assert_eq!(raw(group), Some(DecodeError::RowsWithKeys { field: "groups" }));
        assert_eq!(raw(|s| s.row_count = 4), Some(DecodeError::RowCount { row_count: 4, floats: 6 }));
        assert_eq!(raw(|s| s.row_count = 0), Some(DecodeError::RowCount { row_count: 0, floats: 6 }));
        assert_eq!(raw(|s| s.rows.clear()), Some(DecodeError::RowCount { row_count: 2, floats: 0 }));
        let too_many = |s: &mut RequestSpec| {
            s.rows = vec![0.0; 65];
            s.row_count = 65;
        };
        assert_eq!(raw(too_many), Some(DecodeError::TooManyCandidates { count: 65, candidates_max: 64 }));
        // The explanation limits hold for raw rows too.
        let explain = |s: &mut RequestSpec| s.explain_top_k = 33;
        assert_eq!(raw(explain), Some(DecodeError::ExplainTopK { top_k: 33, top_k_max: EXPLAIN_TOP_K_MAX }));
    }

    #[test]
    fn request_round_trip() {
        let mut out = Vec::new();
        RequestEncoder::new().encode(&spec(3), &mut out);
        let (payload, used) = split_frame(&out, LIMITS.frame_bytes_max).unwrap().unwrap();
        assert_eq!(used, out.len());
        let r = decode_request(payload, &LIMITS).unwrap();
        assert_eq!(r.request_id(), 7);
        assert_eq!(r.budget_us(), 900);
        assert_eq!(r.user_id(), 42);
        assert_eq!(r.model(), "m");
        assert_eq!(r.item_ids().iter().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(r.context().iter().collect::<Vec<_>>(), vec![0.5, -1.0]);
        assert_eq!(r.context_ids().iter().collect::<Vec<_>>(), vec![3, 1 << 40]);
    }

    #[test]
    fn response_round_trip() {
        let mut out = Vec::new();
        let scores = [0.25f32, 0.75];
        let fields = ResponseFields {
            request_id: 9,
            status: Status::Ok,
            scores: &scores,
            tier: Tier::Primary,
            model_version: 3,
            server_us: 12,
            features_missing: 1,
            error: "",
            reason: Reason::Budget,
            features_stale: true,
            explain: ExplainFields {
                skipped: ExplainSkipped::None,
                bias: -1.5,
                candidates: &[1],
                features: &[4, 0],
                contributions: &[0.75, -0.25],
            },
        };
        let mut enc = ResponseEncoder::new(64);
        enc.encode(&fields, &mut out);
        enc.encode(&ResponseFields::failure(10, Status::BadRequest, "nope"), &mut out);
        let (p1, used1) = split_frame(&out, 1 << 16).unwrap().unwrap();
        let r1 = decode_response(p1, 64).unwrap();
        assert_eq!(r1.scores, scores);
        assert_eq!((r1.request_id, r1.model_version, r1.server_us, r1.features_missing), (9, 3, 12, 1));
        assert_eq!(r1.reason, Reason::Budget);
        assert!(r1.features_stale);
        let explained: Vec<(usize, Vec<(u32, f64)>)> =
            r1.explanations.iter().map(|(c, top)| (c, top.collect())).collect();
        assert_eq!(explained, vec![(1, vec![(4, 0.75), (0, -0.25)])]);
        assert_eq!(r1.explanations.bias, -1.5);
        let (p2, _) = split_frame(&out[used1..], 1 << 16).unwrap().unwrap();
        let r2 = decode_response(p2, 64).unwrap();
        assert_eq!((r2.request_id, r2.status, r2.error.as_str()), (10, Status::BadRequest, "nope"));
        assert!(r2.scores.is_empty());
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        let mut out = Vec::new();
        RequestEncoder::new().encode(&spec(3), &mut out);
        for cut in 0..out.len() {
            assert_eq!(split_frame(&out[..cut], LIMITS.frame_bytes_max), Ok(None), "cut at {cut}");
        }
    }

    #[test]
    fn errors_are_one_short_ascii_line() {
        let mut buf = [0u8; ERROR_BYTES_MAX];
        assert_eq!(one_line("  a\n\tb  c\r\nd ", &mut buf), "a b c d");
        assert_eq!(one_line("caf\u{e9} \u{1}x", &mut buf), "caf? x");
        let long = "x".repeat(1000);
        assert_eq!(one_line(&long, &mut buf).len(), ERROR_BYTES_MAX);
        // A FlatBuffers verifier message, as a garbage frame produces it.
        let mut good = Vec::new();
        RequestEncoder::new().encode(&spec(2), &mut good);
        let mut payload = good[FRAME_PREFIX_BYTES..].to_vec();
        let at = payload.len() - 12;
        payload[at..].fill(0xff);
        let Err(e) = decode_request(&payload, &LIMITS) else { panic!("a damaged request verified") };
        let e = e.to_string();
        assert!(e.contains('\n') || e.contains('\t'), "the verifier's message spans lines: {e:?}");
        let mut out = Vec::new();
        ResponseEncoder::new(4).encode(&ResponseFields::failure(1, Status::BadRequest, &e), &mut out);
        let (payload, _) = split_frame(&out, 1 << 16).unwrap().unwrap();
        let r = decode_response(payload, 4).unwrap();
        assert!(!r.error.is_empty() && r.error.len() <= ERROR_BYTES_MAX, "{:?}", r.error);
        assert!(r.error.bytes().all(|c| c.is_ascii_graphic() || c == b' '), "{:?}", r.error);
    }

    #[test]
    fn bad_lengths_are_typed_errors() {
        assert_eq!(split_frame(&[0, 0, 0, 0], 100), Err(FrameError::Empty));
        assert_eq!(
            split_frame(&[0xff, 0xff, 0xff, 0x7f, 1], 100),
            Err(FrameError::TooLarge { len_bytes: 0x7fff_ffff, frame_bytes_max: 100 })
        );
    }

    #[test]
    fn limits_are_enforced() {
        let mut out = Vec::new();
        RequestEncoder::new().encode(&spec(65), &mut out);
        let (payload, _) = split_frame(&out, LIMITS.frame_bytes_max).unwrap().unwrap();
        assert!(matches!(decode_request(payload, &LIMITS), Err(DecodeError::TooManyCandidates { count: 65, .. })));
        assert_eq!(salvage_request_id(payload, &LIMITS), 7);

        out.clear();
        RequestEncoder::new().encode(&spec(0), &mut out);
        let (payload, _) = split_frame(&out, LIMITS.frame_bytes_max).unwrap().unwrap();
        assert!(matches!(decode_request(payload, &LIMITS), Err(DecodeError::NoCandidates)));

        let mut s = spec(2);
        s.context = vec![0.0; 17];
        out.clear();
        RequestEncoder::new().encode(&s, &mut out);
        let (payload, _) = split_frame(&out, LIMITS.frame_bytes_max).unwrap().unwrap();
        assert!(matches!(decode_request(payload, &LIMITS), Err(DecodeError::ContextTooLong { count: 17, .. })));

        let mut s = spec(2);
        s.context_ids = vec![1; 17];
        out.clear();
        RequestEncoder::new().encode(&s, &mut out);
        let (payload, _) = split_frame(&out, LIMITS.frame_bytes_max).unwrap().unwrap();
        assert!(matches!(decode_request(payload, &LIMITS), Err(DecodeError::ContextIdsTooLong { count: 17, .. })));

        // Reason codes: k and the explained count are bounded, typed.
        let explain = |items: usize, top_k: usize, candidates_max: usize| {
            let s = RequestSpec {
                explain_top_k: top_k as u16,
                explain_candidates_max: candidates_max as u16,
                ..spec(items)
            };
            let mut out = Vec::new();
            RequestEncoder::new().encode(&s, &mut out);
            let limits = RequestLimits { candidates_max: 256, ..LIMITS };
            decode_request(&out[FRAME_PREFIX_BYTES..], &limits).map(|r| (r.explain_top_k(), r.explained()))
        };
        assert_eq!(explain(32, 5, 0), Ok((5, 32)));
        assert_eq!(explain(32, 5, 3), Ok((5, 3)));
        assert_eq!(explain(2, 5, 3), Ok((5, 2)));
        assert_eq!(explain(200, 0, 0), Ok((0, 200)), "nothing asked, nothing bounded");
        assert_eq!(explain(200, 5, 64), Ok((5, 64)));
        let top_k = explain(2, EXPLAIN_TOP_K_MAX + 1, 0);
        assert_eq!(top_k, Err(DecodeError::ExplainTopK { top_k: 33, top_k_max: EXPLAIN_TOP_K_MAX }));
        let all = explain(65, 5, 0);
        assert_eq!(all, Err(DecodeError::ExplainCandidates { count: 65, explained_max: EXPLAIN_CANDIDATES_MAX }));
        let asked = explain(2, 5, 65);
        assert_eq!(asked, Err(DecodeError::ExplainCandidates { count: 65, explained_max: EXPLAIN_CANDIDATES_MAX }));
    }

    #[test]
    fn garbage_and_truncated_payloads_fail_verification() {
        let mut out = Vec::new();
        RequestEncoder::new().encode(&spec(8), &mut out);
        let payload = &out[FRAME_PREFIX_BYTES..];
        let full = decode_request(payload, &LIMITS).unwrap();
        for cut in 0..payload.len() {
            // Cutting only unreferenced padding may still verify; then every
            // field must read as in the whole payload.
            if let Ok(r) = decode_request(&payload[..cut], &LIMITS) {
                assert_eq!(r.item_ids().iter().collect::<Vec<_>>(), full.item_ids().iter().collect::<Vec<_>>());
                assert_eq!(r.context().iter().collect::<Vec<_>>(), full.context().iter().collect::<Vec<_>>());
                assert_eq!((r.request_id(), r.user_id(), r.model()), (7, 42, "m"));
                assert!(cut + 8 >= payload.len(), "cut at {cut} of {} verified", payload.len());
            }
        }
        // A deterministic byte soup: every result must be an error, never a panic.
        let mut x = 0x1234_5678_9abc_def0u64;
        for len in 1..512 {
            let soup: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = decode_request(&soup, &LIMITS);
        }
    }
}
