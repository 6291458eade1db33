// The client: one connection per node, any number of calls in flight on
// it (pipelining, answers matched by request id, in any order), a timeout
// per call, typed errors, and failover across nodes.
//
// Scoring reads and changes nothing on the server, so a request whose
// connection failed before its answer came is sent again to the next node
// while its time allows (docs/PROTOCOL.md, "What a client does with each
// answer"); a call whose time ran out is not, since its time is spent. A
// late answer to a timed-out call is dropped, not taken for another's.

import * as net from "node:net";
import * as tls from "node:tls";

import { DEFAULT_LIMITS, decodeResponse, encodeRequest, FrameReader } from "./codec.js";
import type { Id, Limits, Request, Response } from "./codec.js";
import {
  AllNodesFailedError,
  ConnectionClosedError,
  errorFor,
  ProtocolError,
  TimeoutError,
} from "./errors.js";
import { Status } from "./generated/quiver/wire/status.js";

export interface ClientOptions {
  /** Time for one call, connecting included, in ms (default 1000). */
  timeoutMs?: number;
  /** Speak TLS to servers with `[tls]` (e.g. `{ ca: readFileSync(...) }`). */
  tls?: tls.ConnectionOptions;
  /** The server's limits, where they differ from the defaults. */
  limits?: Partial<Limits>;
  /** Reject a non-Ok answer with its `QuiverError` (default true). */
  check?: boolean;
}

export interface CallOptions {
  timeoutMs?: number;
  check?: boolean;
}

/** Most timed-out calls whose late answers a connection still expects;
 * past it the connection is closed (a server that stopped answering). */
const ABANDONED_MAX = 4096;

interface Call {
  id: bigint;
  frame: Uint8Array;
  check: boolean;
  deadlineMs: number;
  tried: Set<number>;
  /** Each node that failed this call, and why. */
  failures: Array<readonly [string, string]>;
  timer: NodeJS.Timeout;
  resolve: (r: Response) => void;
  reject: (e: Error) => void;
  conn?: Connection;
}

function parseAddr(addr: string): { host: string; port: number } {
  const m = /^\[([^\]]+)\]:(\d+)$/.exec(addr) ?? /^([^:]+):(\d+)$/.exec(addr);
  if (!m) throw new RangeError(`node address '${addr}' is not host:port or [v6]:port`);
  const port = Number(m[2]);
  if (!Number.isInteger(port) || port < 1 || port > 65535) throw new RangeError(`bad port in '${addr}'`);
  return { host: m[1], port };
}

/** One node's connection: opened on first use, closed on any failure
 * (its calls then move on), opened again by the next call. */
class Connection {
  readonly calls = new Map<bigint, Call>();
  readonly abandoned = new Set<bigint>();
  private readonly socket: net.Socket;
  private readonly reader: FrameReader;
  closed = false;

  constructor(
    readonly node: number,
    readonly addr: string,
    private readonly client: Client,
    tlsOptions: tls.ConnectionOptions | undefined,
    responseFrameBytesMax: number,
  ) {
    const { host, port } = parseAddr(addr);
    this.reader = new FrameReader(responseFrameBytesMax);
    this.socket = tlsOptions
      ? tls.connect({ host, port, servername: net.isIP(host) ? undefined : host, ...tlsOptions })
      : net.connect({ host, port });
    this.socket.setNoDelay(true);
    this.socket.on("data", (chunk: Buffer) => this.onData(chunk));
    this.socket.on("error", (e: Error) => this.fail(e.message));
    this.socket.on("close", () => this.fail("the server closed the connection"));
  }

  send(call: Call): void {
    call.conn = this;
    this.calls.set(call.id, call);
    this.socket.write(call.frame);
  }

  private onData(chunk: Buffer): void {
    let payloads: Uint8Array[];
    try {
      payloads = this.reader.feed(chunk);
    } catch (e) {
      this.fail((e as Error).message, e as Error);
      return;
    }
    for (const payload of payloads) {
      let response: Response;
      try {
        response = decodeResponse(payload);
      } catch (e) {
        this.fail((e as Error).message, e as Error);
        return;
      }
      const call = this.calls.get(response.requestId);
      if (!call) {
        if (this.abandoned.delete(response.requestId)) continue;
        if (response.requestId === 0n && response.status === Status.BadRequest) {
          // A frame-level refusal: the server closes the connection next.
          this.fail(`the server refused a frame: ${response.error}`);
          return;
        }
        const e = new ProtocolError(`an answer to request ${response.requestId}, which was not sent here`);
        this.fail(e.message, e);
        return;
      }
      this.calls.delete(call.id);
      this.client.answered(call, response);
    }
  }

  /** Forgets a call whose time ran out; its late answer is dropped. */
  abandon(call: Call): void {
    if (this.calls.delete(call.id)) {
      this.abandoned.add(call.id);
      if (this.abandoned.size > ABANDONED_MAX) this.fail("too many calls timed out on this connection");
    }
  }

  fail(why: string, protocol?: Error): void {
    if (this.closed) return;
    this.closed = true;
    this.socket.destroy();
    const calls = [...this.calls.values()];
    this.calls.clear();
    this.client.connectionFailed(this, why, calls, protocol);
  }

  close(): Promise<void> {
    return new Promise((resolve) => {
      if (this.socket.destroyed) return resolve();
      this.socket.once("close", () => resolve());
      this.closed = true;
      this.socket.end();
      setTimeout(() => this.socket.destroy(), 1000).unref();
    });
  }
}

/**
 * A client of one or more Quiver nodes.
 *
 * ```ts
 * const c = new Client(["10.0.0.1:7411", "10.0.0.2:7411"], { timeoutMs: 50 });
 * const r = await c.score({ userId: 42, itemIds: [1, 2, 3], budgetUs: 5000 });
 * console.log(r.scores, Tier[r.tier]);
 * await c.close();
 * ```
 */
export class Client {
  private readonly nodes: string[];
  private readonly conns: Array<Connection | undefined>;
  private readonly limits: Limits;
  private readonly timeoutMs: number;
  private readonly check: boolean;
  private readonly tlsOptions: tls.ConnectionOptions | undefined;
  private readonly outstanding = new Set<bigint>();
  private nextId = 1n;
  private nextNode = 0;
  private closed = false;

  constructor(nodes: string | readonly string[], options: ClientOptions = {}) {
    this.nodes = typeof nodes === "string" ? [nodes] : [...nodes];
    if (this.nodes.length === 0) throw new RangeError("a client needs at least one node");
    this.nodes.forEach(parseAddr);
    this.conns = this.nodes.map(() => undefined);
    this.limits = { ...DEFAULT_LIMITS, ...options.limits };
    this.timeoutMs = options.timeoutMs ?? 1000;
    if (!(this.timeoutMs > 0)) throw new RangeError("timeoutMs must be positive");
    this.check = options.check ?? true;
    this.tlsOptions = options.tls;
  }

  /** Scores one request. Resolves with the response (rejects with its
   * `QuiverError` when it is not Ok, unless `check` is false). */
  score(request: Request, options: CallOptions = {}): Promise<Response> {
    if (this.closed) return Promise.reject(new ConnectionClosedError("the client is closed"));
    let id: bigint;
    let frame: Uint8Array;
    try {
      id = this.takeId(request.requestId);
      frame = encodeRequest(request, id, this.limits);
    } catch (e) {
      return Promise.reject(e);
    }
    this.outstanding.add(id);
    const timeoutMs = options.timeoutMs ?? this.timeoutMs;
    return new Promise<Response>((resolve, reject) => {
      const call: Call = {
        id,
        frame,
        check: options.check ?? this.check,
        deadlineMs: Date.now() + timeoutMs,
        tried: new Set(),
        failures: [],
        timer: setTimeout(() => {
          call.conn?.abandon(call);
          this.settle(call);
          reject(new TimeoutError(`no answer to request ${id} within ${timeoutMs} ms`));
        }, timeoutMs),
        resolve,
        reject,
      };
      this.dispatch(call);
    });
  }

  /** Scores many requests at once, pipelined; answers in request order.
   * Rejects with the first failure in request order once all are in. */
  async scoreMany(requests: readonly Request[], options: CallOptions = {}): Promise<Response[]> {
    const settled = await Promise.allSettled(requests.map((r) => this.score(r, options)));
    const failed = settled.find((s) => s.status === "rejected");
    if (failed) throw (failed as PromiseRejectedResult).reason;
    return settled.map((s) => (s as PromiseFulfilledResult<Response>).value);
  }

  /** Closes every connection; calls still out reject. */
  async close(): Promise<void> {
    this.closed = true;
    await Promise.all(this.conns.map((c) => c?.close()));
  }

  private takeId(given: Id | undefined): bigint {
    if (given !== undefined) {
      const id = typeof given === "bigint" ? given : BigInt(given);
      if (this.outstanding.has(id)) throw new RangeError(`request id ${id} is already in flight`);
      return id;
    }
    // Id 0 is left for the server's frame-level refusals.
    while (this.nextId === 0n || this.outstanding.has(this.nextId)) {
      this.nextId = (this.nextId + 1n) & ((1n << 64n) - 1n);
    }
    const id = this.nextId;
    this.nextId = (this.nextId + 1n) & ((1n << 64n) - 1n);
    return id;
  }

  /** Sends `call` to the next node it has not tried; rejects it when
   * every node has failed it. */
  private dispatch(call: Call): void {
    for (let n = 0; n < this.nodes.length; n++) {
      const node = (this.nextNode + n) % this.nodes.length;
      if (call.tried.has(node)) continue;
      this.nextNode = (node + 1) % this.nodes.length;
      call.tried.add(node);
      let conn = this.conns[node];
      if (!conn || conn.closed) {
        conn = new Connection(node, this.nodes[node], this, this.tlsOptions, this.limits.responseFrameBytesMax);
        this.conns[node] = conn;
      }
      conn.send(call);
      return;
    }
    this.settle(call);
    const failures = call.failures;
    call.reject(
      failures.length === 1
        ? new ConnectionClosedError(`${failures[0][0]}: ${failures[0][1]}`)
        : new AllNodesFailedError(failures),
    );
  }

  private settle(call: Call): void {
    clearTimeout(call.timer);
    this.outstanding.delete(call.id);
  }

  /** Called by a connection with an answer to one of its calls. */
  answered(call: Call, response: Response): void {
    this.settle(call);
    if (call.check && response.status !== Status.Ok) call.reject(errorFor(response));
    else call.resolve(response);
  }

  /** Called by a connection that failed, with the calls it held: each
   * moves to the next node while its time allows. */
  connectionFailed(conn: Connection, why: string, calls: Call[], protocol?: Error): void {
    if (this.conns[conn.node] === conn) this.conns[conn.node] = undefined;
    for (const call of calls) {
      if (protocol) {
        this.settle(call);
        call.reject(protocol);
      } else if (this.closed) {
        this.settle(call);
        call.reject(new ConnectionClosedError("the client was closed"));
      } else if (Date.now() < call.deadlineMs) {
        call.failures.push([conn.addr, why]);
        this.dispatch(call);
      }
    }
  }
}
