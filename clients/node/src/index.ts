// quiver-client: a Node.js client for the Quiver scoring server
// (docs/PROTOCOL.md): the codec, the client and its errors.

export {
  DEFAULT_LIMITS,
  decodeResponse,
  encodeRequest,
  EXPLAIN_CANDIDATES_MAX,
  EXPLAIN_TOP_K_MAX,
  ExplainSkipped,
  FRAME_PREFIX_BYTES,
  FrameReader,
  GROUPS_MAX,
  KEY_BYTES_MAX,
  Reason,
  responseRequestId,
  Status,
  Tier,
} from "./codec.js";
export type { Explanations, GroupKeysArg, GroupsArg, Id, Limits, Request, Response } from "./codec.js";
export { Client } from "./client.js";
export type { CallOptions, ClientOptions } from "./client.js";
export {
  AllNodesFailedError,
  BadRequestError,
  ConnectionClosedError,
  DeadlineExceededError,
  errorFor,
  InternalError,
  ModelNotFoundError,
  OverloadedError,
  ProtocolError,
  QuiverError,
  RateLimitedError,
  TimeoutError,
} from "./errors.js";
