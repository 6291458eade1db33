// The protocol's golden vectors (schemas/vectors/, written by the server's
// own encoders): every response vector decodes to its JSON meaning, and
// every request vector's meaning encodes to the very same bytes (this
// client adds fields in the Rust encoder's order). A missing folder fails.

import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { decodeResponse, encodeRequest, ExplainSkipped, FrameReader, Reason, Status, Tier } from "../src/index.js";
import type { Request } from "../src/index.js";

const VECTORS = fileURLToPath(new URL("../../../../schemas/vectors/", import.meta.url));

interface Doc {
  what: string;
  kind: "requests" | "responses";
  frames: Array<{ bytes: number; meaning: Record<string, unknown> }>;
}

function vectors(kind: Doc["kind"]): Array<[string, Uint8Array, Uint8Array[], Doc]> {
  const names = readdirSync(VECTORS).filter((f) => f.endsWith(".json"));
  assert.ok(names.length > 0, `no golden vectors in ${VECTORS}`);
  const out: Array<[string, Uint8Array, Uint8Array[], Doc]> = [];
  for (const name of names.sort()) {
    const doc = JSON.parse(readFileSync(VECTORS + name, "utf8")) as Doc;
    if (doc.kind !== kind) continue;
    const data = new Uint8Array(readFileSync(VECTORS + name.replace(/\.json$/, ".bin")));
    const reader = new FrameReader(1 << 20);
    const payloads = reader.feed(data);
    assert.equal(reader.pendingBytes, 0, `${name}: trailing bytes`);
    assert.equal(payloads.length, doc.frames.length, `${name}: frame count`);
    out.push([name.replace(/\.json$/, ""), data, payloads, doc]);
  }
  assert.ok(out.length > 0, `no ${kind} vectors in ${VECTORS}`);
  return out;
}

function enumValue(values: object, name: string): number {
  const v = (values as Record<string, unknown>)[name];
  assert.equal(typeof v, "number", `unknown enum member ${name}`);
  return v as number;
}

const bits = (xs: ArrayLike<number>) => Array.from(new Uint32Array(Float32Array.from(xs).buffer));
const ids = (xs: unknown) => (xs === null ? undefined : (xs as string[]).map((x) => BigInt(x)));

function asRequest(m: Record<string, unknown>): Request {
  const groups = m.groups as Array<{ group: string; ids: string[] | null; keys: string[] | null }> | null;
  return {
    userId: BigInt(m.user_id as string),
    itemIds: ids(m.item_ids),
    context: (m.context as number[] | null) ?? undefined,
    contextIds: ids(m.context_ids),
    model: m.model as string | null ?? "",
    budgetUs: m.budget_us as number,
    priority: m.priority as number,
    clientId: m.client_id as number,
    groups: groups?.map((g) => [g.group, g.ids !== null ? ids(g.ids)! : g.keys!] as const),
    explainTopK: (m.explain_top_k as number | undefined) ?? 0,
    explainCandidatesMax: (m.explain_candidates_max as number | undefined) ?? 0,
  };
}

for (const [name, , payloads, doc] of vectors("responses")) {
  test(`response vector ${name} decodes to its meaning`, () => {
    payloads.forEach((payload, i) => {
      const want = doc.frames[i].meaning;
      assert.equal(doc.frames[i].bytes, payload.length + 4);
      const r = decodeResponse(payload);
      assert.equal(r.requestId, BigInt(want.request_id as string));
      assert.equal(r.status, enumValue(Status, want.status as string));
      assert.equal(r.tier, enumValue(Tier, want.tier as string));
      assert.equal(r.reason, enumValue(Reason, want.reason as string));
      assert.deepEqual(bits(r.scores), bits((want.scores as number[] | null) ?? []));
      assert.equal(r.modelVersion, want.model_version);
      assert.equal(r.serverUs, want.server_us);
      assert.equal(r.featuresMissing, want.features_missing);
      assert.equal(r.error, (want.error as string | null) ?? "");
      assert.equal(r.featuresStale, want.features_stale);
      const e = r.explanations;
      assert.equal(e.skipped, enumValue(ExplainSkipped, want.explain_skipped as string));
      assert.deepEqual(Array.from(e.candidates), (want.explain_candidates as number[] | null) ?? []);
      assert.deepEqual(Array.from(e.features), (want.explain_features as number[] | null) ?? []);
      assert.deepEqual(Array.from(e.contributions), (want.explain_contributions as number[] | null) ?? []);
      if (e.candidates.length) assert.equal(e.bias, want.explain_bias);
    });
  });
}

for (const [name, data, , doc] of vectors("requests")) {
  test(`request vector ${name} encodes to the same bytes`, () => {
    const frames: Uint8Array[] = [];
    for (const frame of doc.frames) {
      const m = frame.meaning;
      const request = asRequest(m);
      if ((m.server as string).startsWith("refused")) {
        // The server refuses it; this client does not even send it.
        assert.throws(() => encodeRequest(request, BigInt(m.request_id as string)), RangeError);
        return;
      }
      frames.push(encodeRequest(request, BigInt(m.request_id as string)));
    }
    assert.deepEqual(Buffer.concat(frames), Buffer.from(data));
  });
}
