// The codec without a server: frames split however the bytes arrive, and
// malformed responses are a ProtocolError, never a wrong number or a crash.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import {
  decodeResponse,
  encodeRequest,
  EXPLAIN_CANDIDATES_MAX,
  EXPLAIN_TOP_K_MAX,
  ExplainSkipped,
  FrameReader,
  ProtocolError,
} from "../src/index.js";

const VECTORS = fileURLToPath(new URL("../../../../schemas/vectors/", import.meta.url));
const stream = new Uint8Array(readFileSync(VECTORS + "pipelined_responses.bin"));

test("frames split the same whatever the chunking", () => {
  const whole = new FrameReader().feed(stream).map((p) => Buffer.from(p).toString("hex"));
  assert.equal(whole.length, 3);
  for (const step of [1, 3, 7, 64]) {
    const r = new FrameReader();
    const got: string[] = [];
    for (let at = 0; at < stream.length; at += step) {
      got.push(...r.feed(stream.subarray(at, at + step)).map((p) => Buffer.from(p).toString("hex")));
    }
    assert.deepEqual(got, whole, `chunks of ${step}`);
    assert.equal(r.pendingBytes, 0);
  }
});

test("a zero or oversized length prefix is a ProtocolError", () => {
  assert.throws(() => new FrameReader().feed(new Uint8Array([0, 0, 0, 0])), ProtocolError);
  assert.throws(() => new FrameReader(100).feed(new Uint8Array([101, 0, 0, 0])), ProtocolError);
});

test("every truncation and every single-byte corruption of a response is refused or read in bounds", () => {
  const payload = new FrameReader().feed(new Uint8Array(readFileSync(VECTORS + "response_ok.bin")))[0];
  const good = decodeResponse(payload);
  assert.equal(good.scores.length, 3);
  for (let n = 0; n < payload.length; n++) {
    // A cut frame may still hold a whole table (FlatBuffers writes the
    // table last), so it is refused or decodes; it never throws anything
    // but a ProtocolError.
    try {
      decodeResponse(payload.subarray(0, n));
    } catch (e) {
      assert.ok(e instanceof ProtocolError, `cut at ${n}: ${e}`);
    }
  }
  let refused = 0;
  for (let at = 0; at < payload.length; at++) {
    for (const v of [0x00, 0x7f, 0xff]) {
      const bad = Uint8Array.from(payload);
      bad[at] = v;
      try {
        const r = decodeResponse(bad);
        assert.ok(r.scores.length <= payload.length / 4, "scores read past the frame");
      } catch (e) {
        assert.ok(e instanceof ProtocolError, `byte ${at} = ${v}: ${e}`);
        refused++;
      }
    }
  }
  assert.ok(refused > 0, "some corruption must be refused");
  assert.throws(() => decodeResponse(new Uint8Array(3)), ProtocolError);
});

test("explanations are decoded, and their limits checked before sending", () => {
  const payload = new FrameReader().feed(new Uint8Array(readFileSync(VECTORS + "response_explained.bin")))[0];
  const e = decodeResponse(payload).explanations;
  assert.equal(e.skipped, ExplainSkipped.None);
  assert.deepEqual(Array.from(e.candidates), [0, 2]);
  assert.deepEqual(Array.from(e.features), [7, 1, 3, 7]);
  assert.deepEqual(Array.from(e.contributions), [1.25, -0.5, -0.75, 0.375]);
  assert.equal(e.bias, -2.5);
  for (let n = 0; n < payload.length; n++) {
    try {
      decodeResponse(payload.subarray(0, n));
    } catch (err) {
      assert.ok(err instanceof ProtocolError, `cut at ${n}: ${String(err)}`);
    }
  }
  assert.throws(() => encodeRequest({ itemIds: [1], explainTopK: EXPLAIN_TOP_K_MAX + 1 }, 1n), /explainTopK 33/);
  const many = Array.from({ length: EXPLAIN_CANDIDATES_MAX + 1 }, (_, i) => i);
  assert.throws(() => encodeRequest({ itemIds: many, explainTopK: 1 }, 1n), /65 candidates to explain/);
  encodeRequest({ itemIds: many, explainTopK: 1, explainCandidatesMax: EXPLAIN_CANDIDATES_MAX }, 1n);
});
