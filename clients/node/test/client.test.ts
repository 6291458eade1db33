// The client against real `quiver serve --demo` processes: scores equal the
// Rust client's (`quiver score --json`) bit for bit, pipelining, typed
// errors, timeouts, failover to another node when one is down or killed,
// TLS.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import {
  AllNodesFailedError,
  BadRequestError,
  Client,
  ConnectionClosedError,
  ModelNotFoundError,
  Reason,
  Status,
  Tier,
  TimeoutError,
} from "../src/index.js";
import type { GroupsArg, Response } from "../src/index.js";
import { deadAddr, demoDir, demoRequest, quiverBin, QuiverServer, silentServer } from "./server.js";

let server: QuiverServer;
let spare: QuiverServer;

before(async () => {
  server = await QuiverServer.start(demoDir());
  spare = await QuiverServer.start(demoDir());
});

after(async () => {
  await server?.stop();
  await spare?.stop();
});

const bits = (xs: ArrayLike<number>) => Array.from(new Uint32Array(Float32Array.from(xs).buffer));

test("scores equal the Rust client's bit for bit", async () => {
  const c = new Client(server.addr, { timeoutMs: 10_000 });
  try {
    for (const i of [0, 7, 42]) {
      const req = demoRequest(i);
      const r = await c.score(req);
      const out = execFileSync(
        quiverBin(),
        [
          "score", "--addr", server.addr, "--json", "--user", String(req.userId),
          "--items", req.itemIds.join(","), "--budget-us", String(req.budgetUs),
          "--context=" + req.context.join(","),
        ],
        { encoding: "utf8", timeout: 30_000 },
      );
      const rust = JSON.parse(out) as { scores: number[]; model_version: number; features_missing: number };
      assert.deepEqual(bits(r.scores), bits(rust.scores));
      assert.equal(r.scores.length, 32);
      assert.equal(r.status, Status.Ok);
      assert.equal(r.tier, Tier.Primary);
      assert.equal(r.reason, Reason.None);
      assert.equal(r.modelVersion, rust.model_version);
      assert.equal(r.featuresMissing, rust.features_missing);
    }
  } finally {
    await c.close();
  }
});

test("1,000 pipelined calls on one connection each get their own answer", async () => {
  const c = new Client(server.addr, { timeoutMs: 30_000 });
  try {
    const singles: Response[] = [];
    for (let i = 0; i < 20; i++) singles.push(await c.score(demoRequest(i)));
    const many = await Promise.all(Array.from({ length: 1000 }, (_, i) => c.score(demoRequest(i % 20))));
    many.forEach((r, i) => assert.deepEqual(bits(r.scores), bits(singles[i % 20].scores), `call ${i}`));
    const ordered = await c.scoreMany(Array.from({ length: 50 }, (_, i) => demoRequest(i % 20)));
    ordered.forEach((r, i) => assert.deepEqual(bits(r.scores), bits(singles[i % 20].scores)));
  } finally {
    await c.close();
  }
});

test("a non-Ok answer rejects with its status's error, or resolves with check off", async () => {
  const c = new Client(server.addr, { timeoutMs: 10_000 });
  try {
    await assert.rejects(c.score({ ...demoRequest(1), model: "no-such-model" }), (e: unknown) => {
      assert.ok(e instanceof ModelNotFoundError);
      assert.equal(e.status, Status.ModelNotFound);
      return true;
    });
    await assert.rejects(c.score({ ...demoRequest(1), context: [1, 2, 3] }), (e: unknown) => {
      assert.ok(e instanceof BadRequestError);
      assert.match(e.error, /context has 3 floats/);
      return true;
    });
    const raw = await c.score({ ...demoRequest(1), context: [1, 2, 3] }, { check: false });
    assert.equal(raw.status, Status.BadRequest);
    assert.equal(raw.scores.length, 0);
    // The connection goes on after a refusal.
    assert.equal((await c.score(demoRequest(2))).status, Status.Ok);
  } finally {
    await c.close();
  }
});

test("client-side limits reject before anything is sent", async () => {
  const c = new Client(await deadAddr());
  try {
    await assert.rejects(c.score({ userId: 1, itemIds: Array.from({ length: 257 }, (_, i) => i) }), /257 candidates/);
    await assert.rejects(c.score({ userId: 1, itemIds: [] }), /at least one candidate/);
    await assert.rejects(c.score({ userId: -1, itemIds: [1] }), RangeError);
    await assert.rejects(c.score({ userId: 2 ** 60, itemIds: [1] }), /safe integer/);
    await assert.rejects(c.score({ itemIds: [1], groups: { d: ["a", 1] } as unknown as GroupsArg }), TypeError);
    await assert.rejects(c.score({ itemIds: [1], groups: { d: "x".repeat(65) } }), /65 bytes/);
  } finally {
    await c.close();
  }
});

test("a call with no answer times out", async () => {
  const silent = await silentServer();
  const c = new Client(silent.addr, { timeoutMs: 200 });
  try {
    const t0 = Date.now();
    await assert.rejects(c.score(demoRequest(1)), TimeoutError);
    assert.ok(Date.now() - t0 >= 190);
  } finally {
    await c.close();
    await silent.close();
  }
});

test("a node that is down is skipped; every node down is AllNodesFailedError", async () => {
  const dead = await deadAddr();
  const c = new Client([dead, server.addr], { timeoutMs: 10_000 });
  try {
    for (let i = 0; i < 10; i++) assert.equal((await c.score(demoRequest(i))).status, Status.Ok);
  } finally {
    await c.close();
  }
  const none = new Client([dead, await deadAddr()], { timeoutMs: 5000 });
  try {
    await assert.rejects(none.score(demoRequest(1)), (e: unknown) => {
      assert.ok(e instanceof AllNodesFailedError);
      assert.equal(e.failures.length, 2);
      return true;
    });
  } finally {
    await none.close();
  }
  const one = new Client(dead, { timeoutMs: 5000 });
  try {
    await assert.rejects(one.score(demoRequest(1)), ConnectionClosedError);
  } finally {
    await one.close();
  }
});

test("calls in flight on a node killed mid-run move to the other node; none is lost", async () => {
  const victim = await QuiverServer.start(demoDir(), "--inference", "thread");
  const c = new Client([victim.addr, spare.addr], { timeoutMs: 30_000 });
  try {
    const calls = [];
    for (let i = 0; i < 400; i++) {
      calls.push(c.score(demoRequest(i % 20)));
      if (i === 200) await victim.kill();
    }
    const answers = await Promise.all(calls);
    assert.equal(answers.length, 400);
    for (const r of answers) assert.equal(r.status, Status.Ok);
  } finally {
    await c.close();
    await victim.stop();
  }
});

test("TLS: scores over a server with [tls], and an untrusted certificate is refused", async () => {
  const dir = mkdtempSync(join(tmpdir(), "quiver-node-tls-"));
  const crt = join(dir, "server.crt");
  const key = join(dir, "server.key");
  execFileSync(
    "openssl",
    [
      "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
      "-keyout", key, "-out", crt, "-subj", "/CN=localhost",
      "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:FALSE",
    ],
    { stdio: "ignore", timeout: 60_000 },
  );
  const tlsServer = await QuiverServer.start(demoDir(), "--tls-cert", crt, "--tls-key", key);
  try {
    const c = new Client(tlsServer.addr, { timeoutMs: 10_000, tls: { ca: readFileSync(crt) } });
    try {
      const plain = new Client(server.addr, { timeoutMs: 10_000 });
      const want = await plain.score(demoRequest(3));
      await plain.close();
      const r = await c.score(demoRequest(3));
      assert.deepEqual(bits(r.scores), bits(want.scores));
    } finally {
      await c.close();
    }
    const untrusted = new Client(tlsServer.addr, { timeoutMs: 10_000, tls: {} });
    try {
      await assert.rejects(untrusted.score(demoRequest(3)), ConnectionClosedError);
    } finally {
      await untrusted.close();
    }
  } finally {
    await tlsServer.stop();
  }
});
