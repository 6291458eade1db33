// The C++17 client of the Quiver scoring server (docs/PROTOCOL.md): a
// sans-IO codec (requests to frames, frames out of a byte stream, response
// payloads verified and decoded) and a blocking client that pipelines many
// requests on one connection per node, matches answers by request id, holds
// each call to its timeout, throws one error type per non-Ok status and
// fails over across nodes.
//
// Scoring reads and changes nothing on the server, so requests whose
// connection failed before their answers came are sent again to the next
// node while their time allows; a call whose time ran out is not.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace quiver {

/// The schema's enums (schemas/quiver.fbs), values as on the wire.
enum class Status : uint8_t { Ok = 0, DeadlineExceeded, Overloaded, RateLimited, BadRequest, ModelNotFound, Internal };
enum class Tier : uint8_t { Primary = 0, Cached, Fallback, Default };
enum class Reason : uint8_t { None = 0, Budget, BreakerOpen, Overload, ModelError };
/// Why a request that asked for reason codes got none (docs/PROTOCOL.md,
/// "Explanations").
enum class ExplainSkipped : uint8_t { None = 0, Budget, NotExplainable, LowerRung, Unavailable };

const char* status_name(Status s);
const char* tier_name(Tier t);
const char* reason_name(Reason r);
const char* explain_skipped_name(ExplainSkipped e);

/// One group's keys: `ids` for a u64-keyed group, `keys` for a
/// string-keyed one (the other left empty); one key for a request-scope
/// group, one per candidate otherwise.
struct GroupKeys {
  std::string group;
  std::vector<uint64_t> ids;
  std::vector<std::string> keys;
};

/// One ScoreRequest: every field the schema has.
struct Request {
  std::string model;
  uint32_t budget_us = 0;
  uint8_t priority = 0;
  uint32_t client_id = 0;
  uint64_t user_id = 0;
  std::vector<uint64_t> item_ids;
  std::vector<float> context;
  std::vector<uint64_t> context_ids;
  std::vector<GroupKeys> groups;
  /// Reason codes: each explained candidate's `explain_top_k` features with
  /// the largest contribution to its margin (0: none asked; at most
  /// kExplainTopKMax), of every candidate or of the
  /// `explain_candidates_max` with the highest scores (at most
  /// kExplainCandidatesMax explained).
  uint16_t explain_top_k = 0;
  uint16_t explain_candidates_max = 0;
};

/// One explained candidate: its index in the request and its features
/// with the largest |contribution|, largest first, as (feature index,
/// contribution); its margin is the bias plus every feature's contribution.
struct Explanation {
  uint32_t candidate = 0;
  std::vector<std::pair<uint32_t, double>> top;
};

/// One ScoreResponse: exactly the schema's fields.
struct Response {
  uint64_t request_id = 0;
  Status status = Status::Ok;
  std::vector<float> scores;
  Tier tier = Tier::Primary;
  uint32_t model_version = 0;
  uint32_t server_us = 0;
  uint16_t features_missing = 0;
  std::string error;
  Reason reason = Reason::None;
  bool features_stale = false;
  /// Reason codes (the `explain_*` fields): why none came although asked,
  /// the bias (the margin with no feature known) and `k` (feature index,
  /// contribution) pairs per explained candidate, in `explain_candidates`
  /// order (ascending). Empty when none came; a response whose lengths
  /// disagree reads as explaining nothing rather than misattributing.
  ExplainSkipped explain_skipped = ExplainSkipped::None;
  double explain_bias = 0.0;
  std::vector<uint32_t> explain_candidates;
  std::vector<uint32_t> explain_features;
  std::vector<double> explain_contributions;

  /// The explained candidates with their pairs.
  std::vector<Explanation> explanations() const;
};

/// Limits checked before a request is sent, and on responses; the defaults
/// are the server's (`[limits]`).
struct Limits {
  size_t candidates_max = 256;
  size_t context_len_max = 256;
  size_t frame_bytes_max = 65536;
  size_t response_frame_bytes_max = size_t{1} << 20;
};

constexpr size_t kFramePrefixBytes = 4;
constexpr size_t kGroupsMax = 16;
constexpr size_t kKeyBytesMax = 64;
/// Most features one explained candidate lists (`EXPLAIN_TOP_K_MAX`).
constexpr size_t kExplainTopKMax = 32;
/// Most candidates one request has explained (`EXPLAIN_CANDIDATES_MAX`).
constexpr size_t kExplainCandidatesMax = 64;

/// A request that breaks a limit or a rule before it is sent.
struct InvalidRequest : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
/// Bytes this client cannot read; the connection is closed.
struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// A call's time ran out before its answer came.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// Every node was tried (or the only one failed) and none answered.
struct ConnectionError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// A non-Ok answer; one subclass per status.
struct StatusError : std::runtime_error {
  explicit StatusError(Response r);
  Response response;
};
struct DeadlineExceeded : StatusError {
  using StatusError::StatusError;
};
struct Overloaded : StatusError {
  using StatusError::StatusError;
};
struct RateLimited : StatusError {
  using StatusError::StatusError;
};
struct BadRequest : StatusError {
  using StatusError::StatusError;
};
struct ModelNotFound : StatusError {
  using StatusError::StatusError;
};
struct Internal : StatusError {
  using StatusError::StatusError;
};
/// Throws the StatusError subclass for `r`'s status (r is not Ok).
[[noreturn]] void throw_for(Response r);

/// One request frame (length prefix included); InvalidRequest when a field
/// breaks a limit. Fields are added in the Rust encoder's order, so the
/// bytes are the server's own encoder's (schemas/vectors).
std::vector<uint8_t> encode_request(const Request& request, uint64_t request_id, const Limits& limits = Limits{});

/// Verifies and decodes one response payload (without its prefix);
/// ProtocolError when it does not verify. A status, tier or reason this
/// client does not know reads as Internal, Default, None (and an unknown
/// explain_skipped as None).
Response decode_response(const uint8_t* payload, size_t size);

/// Splits frames out of a byte stream; a length of 0 or over the bound is
/// a ProtocolError (the stream cannot be resynchronised).
class FrameReader {
 public:
  explicit FrameReader(size_t frame_bytes_max = Limits{}.response_frame_bytes_max);
  /// Appends `data` and returns every payload now whole.
  std::vector<std::vector<uint8_t>> feed(const uint8_t* data, size_t size);
  size_t pending_bytes() const { return buf_.size(); }

 private:
  size_t frame_bytes_max_;
  std::vector<uint8_t> buf_;
};

struct ClientOptions {
  /// Time for one call (or one score_many), connecting included.
  std::chrono::milliseconds timeout{1000};
  Limits limits{};
  /// Throw a StatusError for a non-Ok answer (else return it).
  bool check = true;
};

/// A blocking client of one or more nodes ("host:port", "[v6]:port"); not
/// thread-safe: one per thread, or a lock around it.
class Client {
 public:
  explicit Client(std::vector<std::string> nodes, ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// Scores one request.
  Response score(const Request& request);
  /// Scores many requests, pipelined on one connection (answers in request
  /// order); with `check`, throws the first non-Ok answer's error once all
  /// are in.
  std::vector<Response> score_many(const std::vector<Request>& requests);

 private:
  struct Conn;
  std::vector<std::string> nodes_;
  ClientOptions options_;
  std::vector<Conn*> conns_;
  size_t next_node_ = 0;
  uint64_t next_id_ = 1;
};

}  // namespace quiver
