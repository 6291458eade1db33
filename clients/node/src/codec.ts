// The sans-IO codec: requests to frames, frames out of a byte stream, and
// response payloads to `Response`s, checked against the protocol's limits
// (docs/PROTOCOL.md). Nothing here touches a socket, so the golden vectors
// (schemas/vectors/) test it without a server.
//
// Requests are built in the order the Rust encoder adds fields (widest
// first), so this client writes the very bytes the server's own encoder
// writes. Responses are bounds-checked before any field is read: the
// FlatBuffers runtime for TypeScript has no verifier, and a malformed frame
// must be a `ProtocolError`, never a wrong number.

import * as flatbuffers from "flatbuffers";

import { ExplainSkipped } from "./generated/quiver/wire/explain-skipped.js";
import { GroupKeys as FbGroupKeys } from "./generated/quiver/wire/group-keys.js";
import { Reason } from "./generated/quiver/wire/reason.js";
import { ScoreRequest } from "./generated/quiver/wire/score-request.js";
import { ScoreResponse } from "./generated/quiver/wire/score-response.js";
import { Status } from "./generated/quiver/wire/status.js";
import { Tier } from "./generated/quiver/wire/tier.js";
import { ProtocolError } from "./errors.js";

export { ExplainSkipped, Reason, Status, Tier };

/** Bytes of the little-endian u32 length in front of every frame. */
export const FRAME_PREFIX_BYTES = 4;
/** Most `groups` entries one request may carry (the server's bound). */
export const GROUPS_MAX = 16;
/** Longest string key any group accepts, in UTF-8 bytes. */
export const KEY_BYTES_MAX = 64;
/** Most features one explained candidate lists (`explainTopK`). */
export const EXPLAIN_TOP_K_MAX = 32;
/** Most candidates one request has explained. */
export const EXPLAIN_CANDIDATES_MAX = 64;

/** Limits checked before a request is sent, and on responses. The
 * defaults are the server's (`[limits]`); match a server configured
 * otherwise. */
export interface Limits {
  candidatesMax: number;
  contextLenMax: number;
  /** Largest request frame, without its length prefix. */
  frameBytesMax: number;
  /** Largest response frame accepted, without its length prefix. */
  responseFrameBytesMax: number;
}

export const DEFAULT_LIMITS: Readonly<Limits> = Object.freeze({
  candidatesMax: 256,
  contextLenMax: 256,
  frameBytesMax: 65536,
  responseFrameBytesMax: 1 << 20,
});

/** A u64: a bigint, or a number that is a safe non-negative integer. */
export type Id = bigint | number;
/** One group's keys: a bare key (a request-scope group) or one per
 * candidate; ids for a u64-keyed group, strings for a string-keyed one. */
export type GroupKeysArg = Id | string | readonly Id[] | readonly string[] | BigUint64Array;
/** Group name to keys, or (name, keys) pairs in order. */
export type GroupsArg = Readonly<Record<string, GroupKeysArg>> | ReadonlyArray<readonly [string, GroupKeysArg]>;

/** One ScoreRequest: every field the schema has. */
export interface Request {
  /** Left out: the client picks a free id. */
  requestId?: Id;
  model?: string;
  budgetUs?: number;
  priority?: number;
  clientId?: number;
  userId?: Id;
  itemIds?: readonly Id[] | BigUint64Array;
  context?: readonly number[] | Float32Array;
  contextIds?: readonly Id[] | BigUint64Array;
  groups?: GroupsArg;
  /** Reason codes: each explained candidate's `explainTopK` features with
   * the largest contribution to its margin (0 or left out: none; at most
   * `EXPLAIN_TOP_K_MAX`). */
  explainTopK?: number;
  /** Explain only this many of the highest-scored candidates (0 or left
   * out: all; at most `EXPLAIN_CANDIDATES_MAX` are explained). */
  explainCandidatesMax?: number;
}

/** A response's reason codes (the `explain_*` fields). Each explained
 * candidate's margin is `bias` plus the sum of all its contributions. */
export interface Explanations {
  /** Why there are none although the request asked (`None` otherwise). */
  skipped: ExplainSkipped;
  bias: number;
  /** The explained candidates' indices, ascending. */
  candidates: Uint32Array;
  /** k (feature index, contribution) pairs per explained candidate, each
   * candidate's largest |contribution| first, in `candidates` order. */
  features: Uint32Array;
  contributions: Float64Array;
}

/** One ScoreResponse: exactly the schema's fields. */
export interface Response {
  requestId: bigint;
  status: Status;
  /** One score per candidate, in request order; empty unless Ok. */
  scores: Float32Array;
  tier: Tier;
  modelVersion: number;
  serverUs: number;
  featuresMissing: number;
  error: string;
  reason: Reason;
  featuresStale: boolean;
  /** Reason codes, when the request asked for them. */
  explanations: Explanations;
}

const U64_MAX = (1n << 64n) - 1n;

function u64(name: string, v: Id): bigint {
  if (typeof v === "number") {
    if (!Number.isSafeInteger(v)) {
      throw new RangeError(`${name} = ${v} is not a safe integer; pass a bigint`);
    }
    v = BigInt(v);
  } else if (typeof v !== "bigint") {
    throw new TypeError(`${name} must be a bigint or an integer number, got ${typeof v}`);
  }
  if (v < 0n || v > U64_MAX) {
    throw new RangeError(`${name} = ${v} is outside the u64 range`);
  }
  return v;
}

function uint(name: string, v: number | undefined, bits: number): number {
  const value = v ?? 0;
  if (typeof value !== "number" || !Number.isInteger(value) || value < 0 || value >= 2 ** bits) {
    throw new RangeError(`${name} = ${String(value)} is outside the u${bits} range`);
  }
  return value;
}

function ids(name: string, values: readonly Id[] | BigUint64Array | undefined): bigint[] {
  if (values === undefined) return [];
  return Array.from(values as ArrayLike<Id>, (v, i) => u64(`${name}[${i}]`, v));
}

function floats(name: string, values: readonly number[] | Float32Array | undefined): Float32Array {
  if (values === undefined) return new Float32Array(0);
  const out = Float32Array.from(values as ArrayLike<number>);
  for (let i = 0; i < out.length; i++) {
    const v = (values as ArrayLike<number>)[i];
    if (typeof v !== "number") throw new TypeError(`${name}[${i}] must be a number`);
    if (!Number.isFinite(out[i]) && Number.isFinite(v)) {
      throw new RangeError(`${name}[${i}] = ${v} is outside the float32 range`);
    }
  }
  return out;
}

type Keys = { kind: "ids"; keys: bigint[] } | { kind: "strs"; keys: string[] };

const utf8 = new TextEncoder();

function groupKeys(group: string, keys: GroupKeysArg): Keys {
  const list: unknown[] =
    typeof keys === "string" || typeof keys === "number" || typeof keys === "bigint"
      ? [keys]
      : Array.from(keys as ArrayLike<unknown>);
  if (list.length === 0) {
    throw new RangeError(`group '${group}' has no keys: a group takes one key, or one per candidate`);
  }
  const strs = list.filter((k) => typeof k === "string").length;
  if (strs !== 0 && strs !== list.length) {
    throw new TypeError(`group '${group}' mixes id and string keys: a group has one key type`);
  }
  if (strs === 0) {
    return { kind: "ids", keys: list.map((k, i) => u64(`group '${group}' key ${i}`, k as Id)) };
  }
  for (const k of list as string[]) {
    const n = utf8.encode(k).length;
    if (n < 1 || n > KEY_BYTES_MAX) {
      throw new RangeError(`group '${group}': a key of ${n} bytes; keys are 1 to ${KEY_BYTES_MAX} bytes`);
    }
  }
  return { kind: "strs", keys: list as string[] };
}

function groupsOf(groups: GroupsArg | undefined, candidatesMax: number): Array<[string, Keys]> {
  if (groups === undefined) return [];
  const pairs: ReadonlyArray<readonly [string, GroupKeysArg]> = Array.isArray(groups)
    ? (groups as ReadonlyArray<readonly [string, GroupKeysArg]>)
    : Object.entries(groups as Record<string, GroupKeysArg>);
  if (pairs.length > GROUPS_MAX) {
    throw new RangeError(`${pairs.length} feature groups exceed the limit of ${GROUPS_MAX}`);
  }
  const seen = new Set<string>();
  return pairs.map(([name, keys]) => {
    if (typeof name !== "string" || name.length === 0) throw new TypeError("a group needs a name");
    if (seen.has(name)) throw new RangeError(`feature group '${name}' is named twice`);
    seen.add(name);
    const k = groupKeys(name, keys);
    if (k.keys.length > candidatesMax) {
      throw new RangeError(`group '${name}' carries ${k.keys.length} keys, above the limit of ${candidatesMax}`);
    }
    return [name, k];
  });
}

/** One request frame (length prefix included); `RangeError`/`TypeError`
 * when a field breaks a limit or has the wrong type. */
export function encodeRequest(request: Request, requestId: Id, limits: Limits = DEFAULT_LIMITS): Uint8Array {
  const id = u64("requestId", requestId);
  const userId = u64("userId", request.userId ?? 0n);
  const budgetUs = uint("budgetUs", request.budgetUs, 32);
  const priority = uint("priority", request.priority, 8);
  const clientId = uint("clientId", request.clientId, 32);
  const model = request.model ?? "";
  if (typeof model !== "string") throw new TypeError("model must be a string");
  const items = ids("itemIds", request.itemIds);
  const context = floats("context", request.context);
  const contextIds = ids("contextIds", request.contextIds);
  const groups = groupsOf(request.groups, limits.candidatesMax);
  if (items.length === 0 && groups.length === 0) {
    throw new RangeError("a request needs at least one candidate: itemIds is empty and groups names none");
  }
  if (items.length > limits.candidatesMax) {
    throw new RangeError(`${items.length} candidates exceed the limit of ${limits.candidatesMax}`);
  }
  if (context.length > limits.contextLenMax) {
    throw new RangeError(`${context.length} context floats exceed the limit of ${limits.contextLenMax}`);
  }
  if (contextIds.length > limits.contextLenMax) {
    throw new RangeError(`${contextIds.length} context ids exceed the limit of ${limits.contextLenMax}`);
  }
  const topK = uint("explainTopK", request.explainTopK, 16);
  const explainMax = uint("explainCandidatesMax", request.explainCandidatesMax, 16);
  if (topK > EXPLAIN_TOP_K_MAX) {
    throw new RangeError(`explainTopK ${topK} exceeds the limit of ${EXPLAIN_TOP_K_MAX}`);
  }
  if (topK > 0) {
    const candidates = items.length || Math.max(1, ...groups.map(([, k]) => k.keys.length));
    const explained = explainMax ? Math.min(explainMax, candidates) : candidates;
    if (explainMax > EXPLAIN_CANDIDATES_MAX || explained > EXPLAIN_CANDIDATES_MAX) {
      throw new RangeError(
        `${explainMax || explained} candidates to explain exceed the limit of ${EXPLAIN_CANDIDATES_MAX}: ` +
          "set explainCandidatesMax",
      );
    }
  }

  const b = new flatbuffers.Builder(256);
  // Strings and vectors in the Rust encoder's order, then the fields.
  const modelAt = model ? b.createString(model) : 0;
  const itemsAt = items.length || !groups.length ? ScoreRequest.createItemIdsVector(b, items) : 0;
  const contextAt = context.length ? ScoreRequest.createContextVector(b, context) : 0;
  const contextIdsAt = contextIds.length ? ScoreRequest.createContextIdsVector(b, contextIds) : 0;
  let groupsAt = 0;
  if (groups.length) {
    const tables = groups.map(([name, keys]) => {
      const nameAt = b.createString(name);
      let idsAt = 0;
      let keysAt = 0;
      if (keys.kind === "ids") {
        idsAt = FbGroupKeys.createIdsVector(b, keys.keys);
      } else {
        keysAt = FbGroupKeys.createKeysVector(
          b,
          keys.keys.map((k) => b.createString(k)),
        );
      }
      FbGroupKeys.startGroupKeys(b);
      if (keysAt) FbGroupKeys.addKeys(b, keysAt);
      if (idsAt) FbGroupKeys.addIds(b, idsAt);
      FbGroupKeys.addGroup(b, nameAt);
      return FbGroupKeys.endGroupKeys(b);
    });
    groupsAt = ScoreRequest.createGroupsVector(b, tables);
  }
  ScoreRequest.startScoreRequest(b);
  ScoreRequest.addUserId(b, userId);
  ScoreRequest.addRequestId(b, id);
  if (groupsAt) ScoreRequest.addGroups(b, groupsAt);
  if (contextIdsAt) ScoreRequest.addContextIds(b, contextIdsAt);
  if (contextAt) ScoreRequest.addContext(b, contextAt);
  if (itemsAt) ScoreRequest.addItemIds(b, itemsAt);
  ScoreRequest.addClientId(b, clientId);
  ScoreRequest.addBudgetUs(b, budgetUs);
  if (modelAt) ScoreRequest.addModel(b, modelAt);
  ScoreRequest.addExplainCandidatesMax(b, explainMax);
  ScoreRequest.addExplainTopK(b, topK);
  ScoreRequest.addPriority(b, priority);
  b.finish(ScoreRequest.endScoreRequest(b));
  const payload = b.asUint8Array();
  if (payload.length > limits.frameBytesMax) {
    throw new RangeError(`request frame of ${payload.length} bytes exceeds the limit of ${limits.frameBytesMax}`);
  }
  const frame = new Uint8Array(FRAME_PREFIX_BYTES + payload.length);
  new DataView(frame.buffer).setUint32(0, payload.length, true);
  frame.set(payload, FRAME_PREFIX_BYTES);
  return frame;
}

/** Checks that the response table and every field it holds lie inside
 * `payload` (what the Rust and Python decoders' verifiers check), so the
 * reads after it see the frame's own bytes. */
function verifyResponse(payload: Uint8Array): void {
  const len = payload.length;
  const view = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
  const need = (ok: boolean, what: string) => {
    if (!ok) throw new ProtocolError(`malformed response: ${what}`);
  };
  need(len >= 8, `${len} bytes`);
  const table = view.getUint32(0, true);
  need(table % 4 === 0 && table + 4 <= len, "root offset out of range");
  const vtable = table - view.getInt32(table, true);
  need(vtable >= 0 && vtable % 2 === 0 && vtable + 4 <= len, "vtable out of range");
  const vtableBytes = view.getUint16(vtable, true);
  const tableBytes = view.getUint16(vtable + 2, true);
  need(vtableBytes >= 4 && vtableBytes % 2 === 0 && vtable + vtableBytes <= len, "vtable size");
  need(table + tableBytes <= len, "table size");
  const field = (slot: number): number => {
    const at = 4 + 2 * slot;
    return at < vtableBytes ? view.getUint16(vtable + at, true) : 0;
  };
  // Scalars: request_id u64, status u8, tier u8, model_version u32,
  // server_us u32, features_missing u16, reason u8, features_stale bool,
  // explain_bias f64, explain_skipped u8.
  const scalars: Array<[number, number]> = [
    [0, 8],
    [1, 1],
    [3, 1],
    [4, 4],
    [5, 4],
    [6, 2],
    [8, 1],
    [9, 1],
    [11, 8],
    [14, 1],
  ];
  for (const [slot, size] of scalars) {
    const off = field(slot);
    need(off === 0 || off + size <= tableBytes, `field ${slot} outside the table`);
  }
  // scores: [float]; error: string; explain_candidates: [uint];
  // explain_features: [uint]; explain_contributions: [double].
  for (const [slot, elem, isString] of [
    [2, 4, false],
    [7, 1, true],
    [10, 4, false],
    [12, 4, false],
    [13, 8, false],
  ] as Array<[number, number, boolean]>) {
    const off = field(slot);
    if (off === 0) continue;
    need(off + 4 <= tableBytes, `field ${slot} outside the table`);
    const at = table + off;
    const vec = at + view.getUint32(at, true);
    need(vec % 4 === 0 && vec + 4 <= len, `field ${slot} offset out of range`);
    const n = view.getUint32(vec, true);
    need(vec + 4 + n * elem + (isString ? 1 : 0) <= len, `field ${slot} runs past the frame`);
    if (isString) need(payload[vec + 4 + n] === 0, "string without its terminator");
  }
}

function known<T extends number>(values: object, value: number, unknown: T): T {
  return Object.values(values).includes(value) ? (value as T) : unknown;
}

/** Decodes one response payload (without its length prefix). */
export function decodeResponse(payload: Uint8Array): Response {
  verifyResponse(payload);
  const r = ScoreResponse.getRootAsScoreResponse(new flatbuffers.ByteBuffer(payload));
  const n = r.scoresLength();
  const scores = new Float32Array(n);
  for (let i = 0; i < n; i++) scores[i] = r.scores(i) ?? 0;
  const error = r.error();
  return {
    requestId: r.requestId(),
    // A value this client does not know reads as Internal, Default, None.
    status: known(Status, r.status(), Status.Internal),
    scores,
    tier: known(Tier, r.tier(), Tier.Default),
    modelVersion: r.modelVersion(),
    serverUs: r.serverUs(),
    featuresMissing: r.featuresMissing(),
    error: typeof error === "string" ? error : "",
    reason: known(Reason, r.reason(), Reason.None),
    featuresStale: r.featuresStale(),
    explanations: explanationsOf(r),
  };
}

/** The `explain_*` fields (bounds checked by `verifyResponse`); lengths
 * that disagree read as no explanation rather than a misattributed one. */
function explanationsOf(r: ScoreResponse): Explanations {
  const skipped = known(ExplainSkipped, r.explainSkipped(), ExplainSkipped.None);
  const n = r.explainCandidatesLength();
  const pairs = r.explainFeaturesLength();
  if (n === 0 || pairs !== r.explainContributionsLength() || pairs % n !== 0) {
    const none = { candidates: new Uint32Array(0), features: new Uint32Array(0) };
    return { skipped, bias: 0, ...none, contributions: new Float64Array(0) };
  }
  const candidates = new Uint32Array(n);
  for (let i = 0; i < n; i++) candidates[i] = r.explainCandidates(i) ?? 0;
  const features = new Uint32Array(pairs);
  const contributions = new Float64Array(pairs);
  for (let i = 0; i < pairs; i++) {
    features[i] = r.explainFeatures(i) ?? 0;
    contributions[i] = r.explainContributions(i) ?? 0;
  }
  return { skipped, bias: r.explainBias(), candidates, features, contributions };
}

/** The request id of a response payload, after the same checks. */
export function responseRequestId(payload: Uint8Array): bigint {
  verifyResponse(payload);
  return ScoreResponse.getRootAsScoreResponse(new flatbuffers.ByteBuffer(payload)).requestId();
}

/** Splits frames out of a byte stream: feed it what a socket gives,
 * take whole payloads back. A length of 0 or over the bound is a
 * `ProtocolError` (the stream cannot be resynchronised). */
export class FrameReader {
  private buf = new Uint8Array(0);

  constructor(private readonly frameBytesMax: number = DEFAULT_LIMITS.responseFrameBytesMax) {}

  feed(chunk: Uint8Array): Uint8Array[] {
    const joined = new Uint8Array(this.buf.length + chunk.length);
    joined.set(this.buf, 0);
    joined.set(chunk, this.buf.length);
    const out: Uint8Array[] = [];
    let at = 0;
    const view = new DataView(joined.buffer, joined.byteOffset, joined.byteLength);
    while (joined.length - at >= FRAME_PREFIX_BYTES) {
      const n = view.getUint32(at, true);
      if (n === 0 || n > this.frameBytesMax) {
        throw new ProtocolError(`a frame of ${n} bytes (the bound is 1 to ${this.frameBytesMax})`);
      }
      if (joined.length - at - FRAME_PREFIX_BYTES < n) break;
      out.push(joined.subarray(at + FRAME_PREFIX_BYTES, at + FRAME_PREFIX_BYTES + n));
      at += FRAME_PREFIX_BYTES + n;
    }
    this.buf = joined.slice(at);
    return out;
  }

  /** Bytes of a frame not yet whole. */
  get pendingBytes(): number {
    return this.buf.length;
  }
}
