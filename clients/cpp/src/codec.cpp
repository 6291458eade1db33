// The sans-IO codec: requests to frames (in the Rust encoder's field order,
// so the bytes are the server's own), response payloads verified with
// explicit depth and table bounds before any field is read, and frames
// split out of a byte stream.

#include <algorithm>
#include <cstring>

#include "quiver/client.hpp"
#include "quiver_generated.h"

namespace fbw = quiver::wire;

namespace quiver {

const char* status_name(Status s) {
  switch (s) {
    case Status::Ok: return "Ok";
    case Status::DeadlineExceeded: return "DeadlineExceeded";
    case Status::Overloaded: return "Overloaded";
    case Status::RateLimited: return "RateLimited";
    case Status::BadRequest: return "BadRequest";
    case Status::ModelNotFound: return "ModelNotFound";
    case Status::Internal: return "Internal";
  }
  return "Internal";
}

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::Primary: return "Primary";
    case Tier::Cached: return "Cached";
    case Tier::Fallback: return "Fallback";
    case Tier::Default: return "Default";
  }
  return "Default";
}

const char* reason_name(Reason r) {
  switch (r) {
    case Reason::None: return "None";
    case Reason::Budget: return "Budget";
    case Reason::BreakerOpen: return "BreakerOpen";
    case Reason::Overload: return "Overload";
    case Reason::ModelError: return "ModelError";
  }
  return "None";
}

const char* explain_skipped_name(ExplainSkipped e) {
  switch (e) {
    case ExplainSkipped::None: return "None";
    case ExplainSkipped::Budget: return "Budget";
    case ExplainSkipped::NotExplainable: return "NotExplainable";
    case ExplainSkipped::LowerRung: return "LowerRung";
    case ExplainSkipped::Unavailable: return "Unavailable";
  }
  return "None";
}

std::vector<Explanation> Response::explanations() const {
  std::vector<Explanation> out;
  const size_t n = explain_candidates.size();
  if (n == 0) return out;
  const size_t k = explain_features.size() / n;
  for (size_t i = 0; i < n; i++) {
    Explanation e{explain_candidates[i], {}};
    for (size_t j = i * k; j < (i + 1) * k; j++) e.top.emplace_back(explain_features[j], explain_contributions[j]);
    out.push_back(std::move(e));
  }
  return out;
}

StatusError::StatusError(Response r)
    : std::runtime_error(std::string(status_name(r.status)) + " (request " + std::to_string(r.request_id) +
                         "): " + (r.error.empty() ? "no reason given" : r.error)),
      response(std::move(r)) {}

void throw_for(Response r) {
  switch (r.status) {
    case Status::DeadlineExceeded: throw DeadlineExceeded(std::move(r));
    case Status::Overloaded: throw Overloaded(std::move(r));
    case Status::RateLimited: throw RateLimited(std::move(r));
    case Status::BadRequest: throw BadRequest(std::move(r));
    case Status::ModelNotFound: throw ModelNotFound(std::move(r));
    default: throw Internal(std::move(r));
  }
}

std::vector<uint8_t> encode_request(const Request& r, uint64_t request_id, const Limits& limits) {
  if (r.item_ids.empty() && r.groups.empty()) {
    throw InvalidRequest("a request needs at least one candidate: item_ids is empty and groups names none");
  }
  if (r.item_ids.size() > limits.candidates_max) {
    throw InvalidRequest(std::to_string(r.item_ids.size()) + " candidates exceed the limit of " +
                         std::to_string(limits.candidates_max));
  }
  if (r.context.size() > limits.context_len_max) {
    throw InvalidRequest(std::to_string(r.context.size()) + " context floats exceed the limit of " +
                         std::to_string(limits.context_len_max));
  }
  if (r.context_ids.size() > limits.context_len_max) {
    throw InvalidRequest(std::to_string(r.context_ids.size()) + " context ids exceed the limit of " +
                         std::to_string(limits.context_len_max));
  }
  if (r.groups.size() > kGroupsMax) {
    throw InvalidRequest(std::to_string(r.groups.size()) + " feature groups exceed the limit of " +
                         std::to_string(kGroupsMax));
  }
  if (r.explain_top_k > kExplainTopKMax) {
    throw InvalidRequest("explain_top_k " + std::to_string(r.explain_top_k) + " exceeds the limit of " +
                         std::to_string(kExplainTopKMax));
  }
  if (r.explain_top_k > 0) {
    size_t candidates = r.item_ids.size();
    if (candidates == 0) {
      for (const auto& g : r.groups) candidates = std::max({candidates, g.ids.size(), g.keys.size()});
    }
    const size_t asked = r.explain_candidates_max;
    const size_t explained = asked > 0 ? std::min(asked, candidates) : candidates;
    if (asked > kExplainCandidatesMax || explained > kExplainCandidatesMax) {
      throw InvalidRequest(std::to_string(asked > 0 ? asked : explained) +
                           " candidates to explain exceed the limit of " + std::to_string(kExplainCandidatesMax) +
                           ": set explain_candidates_max");
    }
  }
  for (size_t i = 0; i < r.groups.size(); i++) {
    const auto& g = r.groups[i];
    if (g.group.empty()) throw InvalidRequest("group entry " + std::to_string(i) + " names no group");
    for (size_t j = 0; j < i; j++) {
      if (r.groups[j].group == g.group) throw InvalidRequest("feature group '" + g.group + "' is named twice");
    }
    if (g.ids.empty() == g.keys.empty()) {
      throw InvalidRequest("group '" + g.group + "' needs ids or string keys, not both or neither");
    }
    if (std::max(g.ids.size(), g.keys.size()) > limits.candidates_max) {
      throw InvalidRequest("group '" + g.group + "' carries more keys than the limit of " +
                           std::to_string(limits.candidates_max));
    }
    for (const auto& k : g.keys) {
      if (k.empty() || k.size() > kKeyBytesMax) {
        throw InvalidRequest("group '" + g.group + "': a key of " + std::to_string(k.size()) + " bytes; keys are 1 to " +
                             std::to_string(kKeyBytesMax) + " bytes");
      }
    }
  }

  flatbuffers::FlatBufferBuilder b(256);
  // Strings and vectors in the Rust encoder's order, then the fields.
  flatbuffers::Offset<flatbuffers::String> model;
  if (!r.model.empty()) model = b.CreateString(r.model);
  flatbuffers::Offset<flatbuffers::Vector<uint64_t>> items;
  if (!r.item_ids.empty() || r.groups.empty()) items = b.CreateVector(r.item_ids);
  flatbuffers::Offset<flatbuffers::Vector<float>> context;
  if (!r.context.empty()) context = b.CreateVector(r.context);
  flatbuffers::Offset<flatbuffers::Vector<uint64_t>> context_ids;
  if (!r.context_ids.empty()) context_ids = b.CreateVector(r.context_ids);
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<fbw::GroupKeys>>> groups;
  if (!r.groups.empty()) {
    std::vector<flatbuffers::Offset<fbw::GroupKeys>> tables;
    for (const auto& g : r.groups) {
      auto name = b.CreateString(g.group);
      flatbuffers::Offset<flatbuffers::Vector<uint64_t>> ids;
      flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<flatbuffers::String>>> keys;
      if (!g.ids.empty()) {
        ids = b.CreateVector(g.ids);
      } else {
        std::vector<flatbuffers::Offset<flatbuffers::String>> strs;
        for (const auto& k : g.keys) strs.push_back(b.CreateString(k));
        keys = b.CreateVector(strs);
      }
      tables.push_back(fbw::CreateGroupKeys(b, name, ids, keys));
    }
    groups = b.CreateVector(tables);
  }
  b.Finish(fbw::CreateScoreRequest(b, request_id, model, r.budget_us, r.priority, r.client_id, r.user_id, items,
                                   context, context_ids, groups, r.explain_top_k, r.explain_candidates_max));
  const size_t n = b.GetSize();
  if (n > limits.frame_bytes_max) {
    throw InvalidRequest("request frame of " + std::to_string(n) + " bytes exceeds the limit of " +
                         std::to_string(limits.frame_bytes_max));
  }
  std::vector<uint8_t> frame(kFramePrefixBytes + n);
  const uint32_t len = static_cast<uint32_t>(n);
  for (size_t i = 0; i < kFramePrefixBytes; i++) frame[i] = static_cast<uint8_t>(len >> (8 * i));
  std::memcpy(frame.data() + kFramePrefixBytes, b.GetBufferPointer(), n);
  return frame;
}

template <typename E>
static E known(uint8_t v, uint8_t max, E unknown) {
  return v <= max ? static_cast<E>(v) : unknown;
}

Response decode_response(const uint8_t* payload, size_t size) {
  // ScoreResponse holds vectors and a string: nothing nests deeper.
  flatbuffers::Verifier v(payload, size, /*max_depth=*/4, /*max_tables=*/8);
  if (!v.VerifyBuffer<fbw::ScoreResponse>(nullptr)) throw ProtocolError("malformed response: it does not verify");
  const auto* r = flatbuffers::GetRoot<fbw::ScoreResponse>(payload);
  Response out;
  out.request_id = r->request_id();
  out.status = known(static_cast<uint8_t>(r->status()), 6, Status::Internal);
  if (const auto* s = r->scores()) out.scores.assign(s->begin(), s->end());
  out.tier = known(static_cast<uint8_t>(r->tier()), 3, Tier::Default);
  out.model_version = r->model_version();
  out.server_us = r->server_us();
  out.features_missing = r->features_missing();
  if (const auto* e = r->error()) out.error = e->str();
  out.reason = known(static_cast<uint8_t>(r->reason()), 4, Reason::None);
  out.features_stale = r->features_stale();
  out.explain_skipped = known(static_cast<uint8_t>(r->explain_skipped()), 4, ExplainSkipped::None);
  const auto* candidates = r->explain_candidates();
  const auto* features = r->explain_features();
  const auto* contributions = r->explain_contributions();
  const size_t n = candidates ? candidates->size() : 0;
  const size_t pairs = features ? features->size() : 0;
  // Lengths that disagree explain nothing rather than misattribute.
  if (n > 0 && contributions && contributions->size() == pairs && pairs % n == 0) {
    out.explain_bias = r->explain_bias();
    out.explain_candidates.assign(candidates->begin(), candidates->end());
    out.explain_features.assign(features->begin(), features->end());
    out.explain_contributions.assign(contributions->begin(), contributions->end());
  }
  return out;
}

FrameReader::FrameReader(size_t frame_bytes_max) : frame_bytes_max_(frame_bytes_max) {}

std::vector<std::vector<uint8_t>> FrameReader::feed(const uint8_t* data, size_t size) {
  buf_.insert(buf_.end(), data, data + size);
  std::vector<std::vector<uint8_t>> out;
  size_t at = 0;
  while (buf_.size() - at >= kFramePrefixBytes) {
    uint32_t n = 0;
    for (size_t i = 0; i < kFramePrefixBytes; i++) n |= uint32_t{buf_[at + i]} << (8 * i);
    if (n == 0 || n > frame_bytes_max_) {
      throw ProtocolError("a frame of " + std::to_string(n) + " bytes (the bound is 1 to " +
                          std::to_string(frame_bytes_max_) + ")");
    }
    if (buf_.size() - at - kFramePrefixBytes < n) break;
    const auto* p = buf_.data() + at + kFramePrefixBytes;
    out.emplace_back(p, p + n);
    at += kFramePrefixBytes + n;
  }
  buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(at));
  return out;
}

}  // namespace quiver
