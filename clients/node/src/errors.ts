// Errors: one class per non-Ok status, plus the transport's. A non-Ok
// answer rejects with the subclass for its status (unless the call asked
// for the raw response), carrying the status, the server's error line, the
// request id and the whole response; `ProtocolError` is bytes this client
// cannot read, and `TimeoutError`/`ConnectionClosedError`/
// `AllNodesFailedError` are failures below the protocol.

import type { Response } from "./codec.js";
import { Status } from "./generated/quiver/wire/status.js";

/** The server answered with a non-Ok status. */
export class QuiverError extends Error {
  readonly status: Status;
  readonly error: string;
  readonly requestId: bigint;
  readonly response: Response;

  constructor(response: Response) {
    const name = Status[response.status] ?? "Internal";
    super(`${name} (request ${response.requestId}): ${response.error || "no reason given"}`);
    this.name = new.target.name;
    this.status = response.status;
    this.error = response.error;
    this.requestId = response.requestId;
    this.response = response;
  }
}

/** The budget was spent before any rung of the ladder could answer. */
export class DeadlineExceededError extends QuiverError {}
/** The request was shed, the inference stage was full, or the node is drained. */
export class OverloadedError extends QuiverError {}
/** The client id (or source) is over its rate, or not allowed from here. */
export class RateLimitedError extends QuiverError {}
/** The request broke a limit or does not fit the served model; never retried. */
export class BadRequestError extends QuiverError {}
/** No served model has the requested name. */
export class ModelNotFoundError extends QuiverError {}
/** The server failed, or sent a status this client does not know. */
export class InternalError extends QuiverError {}

const BY_STATUS: Record<number, new (r: Response) => QuiverError> = {
  [Status.DeadlineExceeded]: DeadlineExceededError,
  [Status.Overloaded]: OverloadedError,
  [Status.RateLimited]: RateLimitedError,
  [Status.BadRequest]: BadRequestError,
  [Status.ModelNotFound]: ModelNotFoundError,
  [Status.Internal]: InternalError,
};

/** The error for a non-Ok response. */
export function errorFor(response: Response): QuiverError {
  const cls = BY_STATUS[response.status] ?? InternalError;
  return new cls(response);
}

/** The server sent bytes this client cannot read; the connection is closed. */
export class ProtocolError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "ProtocolError";
  }
}

/** A call's time ran out before its answer came. */
export class TimeoutError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "TimeoutError";
  }
}

/** The connection closed (or could not open) before the answer came. */
export class ConnectionClosedError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "ConnectionClosedError";
  }
}

/** Every node was tried and none answered. */
export class AllNodesFailedError extends Error {
  readonly failures: ReadonlyArray<readonly [string, string]>;

  constructor(failures: ReadonlyArray<readonly [string, string]>) {
    super(`every node failed: ${failures.map(([n, why]) => `${n}: ${why}`).join("; ")}`);
    this.name = "AllNodesFailedError";
    this.failures = failures;
  }
}
