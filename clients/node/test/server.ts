// Test helpers: the `quiver` binary, the demo data, `quiver serve` on a
// free port (stopped by PID), and a fake server that never answers.

import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync } from "node:fs";
import * as net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

/** `QUIVER_BIN`, else the release build of this checkout; a missing
 * binary fails the tests, it never skips them. */
export const QUIVER_BIN =
  process.env.QUIVER_BIN ?? fileURLToPath(new URL("../../../../target/release/quiver", import.meta.url));

export function quiverBin(): string {
  assert.ok(existsSync(QUIVER_BIN), `${QUIVER_BIN} does not exist: run \`cargo build --release\` or set QUIVER_BIN`);
  return QUIVER_BIN;
}

let demo: string | undefined;

/** The demo's data (`quiver demo`), built once per process. */
export function demoDir(): string {
  if (!demo) {
    demo = mkdtempSync(join(tmpdir(), "quiver-node-demo-"));
    execFileSync(quiverBin(), ["demo", "--data-dir", demo], { stdio: "ignore", timeout: 60_000 });
  }
  return demo;
}

/** A `quiver serve` process on a free port, one shard. */
export class QuiverServer {
  addr = "";
  private readonly proc: ChildProcess;
  private log = "";

  private constructor(args: string[]) {
    this.proc = spawn(quiverBin(), args, { stdio: ["ignore", "pipe", "pipe"] });
    this.proc.stderr!.on("data", (d: Buffer) => {
      this.log = (this.log + d.toString()).slice(-20_000);
    });
  }

  static start(dataDir: string, ...extra: string[]): Promise<QuiverServer> {
    const args = ["serve", "--data-dir", dataDir, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"];
    const s = new QuiverServer([...args, "--shards", "1", ...extra]);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        s.stop();
        reject(new Error(`quiver serve did not listen within 30 s:\n${s.log}`));
      }, 30_000);
      let out = "";
      s.proc.stdout!.on("data", (d: Buffer) => {
        out += d.toString();
        const m = /quiver listening on (\S+)/.exec(out);
        if (m && !s.addr) {
          s.addr = m[1];
          clearTimeout(timer);
          resolve(s);
        }
      });
      s.proc.on("exit", (code) => {
        if (!s.addr) {
          clearTimeout(timer);
          reject(new Error(`quiver serve exited (${code}) before listening:\n${s.log}`));
        }
      });
    });
  }

  /** SIGTERM by PID, SIGKILL after 5 s. */
  stop(): Promise<void> {
    return new Promise((resolve) => {
      if (this.proc.exitCode !== null || this.proc.signalCode !== null) return resolve();
      const kill = setTimeout(() => this.proc.kill("SIGKILL"), 5000);
      this.proc.once("exit", () => {
        clearTimeout(kill);
        resolve();
      });
      this.proc.kill("SIGTERM");
    });
  }

  /** SIGKILL by PID, at once. */
  kill(): Promise<void> {
    return new Promise((resolve) => {
      if (this.proc.exitCode !== null || this.proc.signalCode !== null) return resolve();
      this.proc.once("exit", () => resolve());
      this.proc.kill("SIGKILL");
    });
  }
}

/** A TCP server that accepts and reads but never answers. */
export async function silentServer(): Promise<{ addr: string; close: () => Promise<void> }> {
  const sockets = new Set<net.Socket>();
  const server = net.createServer((s) => {
    sockets.add(s);
    s.on("data", () => {});
    s.on("close", () => sockets.delete(s));
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const port = (server.address() as net.AddressInfo).port;
  return {
    addr: `127.0.0.1:${port}`,
    close: () =>
      new Promise<void>((r) => {
        sockets.forEach((s) => s.destroy());
        server.close(() => r());
      }),
  };
}

/** A port nothing listens on (bound, then closed). */
export async function deadAddr(): Promise<string> {
  const server = net.createServer();
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const port = (server.address() as net.AddressInfo).port;
  await new Promise<void>((r) => server.close(() => r()));
  return `127.0.0.1:${port}`;
}

export const USERS = 100_000;
export const ITEMS = 10_000;
export const CONTEXT_LEN = 16;
export const BIG_BUDGET_US = 1_000_000;

const f32 = (x: number) => Math.fround(x);

/** Demo request i, as the Python tests' `demo_request` builds it. */
export function demoRequest(i: number) {
  return {
    userId: (i * 7919 + 13) % USERS,
    itemIds: Array.from({ length: 32 }, (_, k) => (i * 131 + k * 977) % ITEMS),
    context: Array.from({ length: CONTEXT_LEN }, (_, k) => f32(f32(((i + k) % 7) * f32(0.3)) - f32(0.9))),
    budgetUs: BIG_BUDGET_US,
  };
}
