// The protocol's golden vectors (schemas/vectors/, written by the server's
// own encoders): every response vector decodes to its JSON meaning (reason
// codes included), and every request vector's meaning encodes to the very
// same bytes (request_explain: the explain fields). A missing folder fails.

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "check.hpp"
#include "quiver/client.hpp"

using nlohmann::json;
namespace fs = std::filesystem;

static std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

static uint64_t u64(const json& v) { return std::stoull(v.get<std::string>()); }

static std::vector<uint64_t> ids(const json& v) {
  std::vector<uint64_t> out;
  if (!v.is_null())
    for (const auto& x : v) out.push_back(u64(x));
  return out;
}

static uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

static uint64_t bits64(double f) {
  uint64_t b;
  std::memcpy(&b, &f, 8);
  return b;
}

template <typename T>
static std::vector<T> list(const json& v) {
  return v.is_null() ? std::vector<T>{} : v.get<std::vector<T>>();
}

int main() {
  const fs::path dir = QUIVER_VECTORS;
  int requests = 0, responses = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    const std::string name = entry.path().stem().string();
    json doc = json::parse(std::ifstream(entry.path()));
    auto data = read_bytes(fs::path(entry.path()).replace_extension(".bin"));
    quiver::FrameReader reader(1 << 20);
    auto payloads = reader.feed(data.data(), data.size());
    CHECK(reader.pending_bytes() == 0, name);
    CHECK(payloads.size() == doc["frames"].size(), name);
    if (doc["kind"] == "responses") {
      responses++;
      for (size_t i = 0; i < payloads.size() && i < doc["frames"].size(); i++) {
        const auto& m = doc["frames"][i]["meaning"];
        auto r = quiver::decode_response(payloads[i].data(), payloads[i].size());
        CHECK(r.request_id == u64(m["request_id"]), name);
        CHECK(quiver::status_name(r.status) == m["status"].get<std::string>(), name);
        CHECK(quiver::tier_name(r.tier) == m["tier"].get<std::string>(), name);
        CHECK(quiver::reason_name(r.reason) == m["reason"].get<std::string>(), name);
        std::vector<float> want;
        if (!m["scores"].is_null())
          for (const auto& s : m["scores"]) want.push_back(static_cast<float>(s.get<double>()));
        CHECK(r.scores.size() == want.size(), name);
        for (size_t k = 0; k < want.size() && k < r.scores.size(); k++) CHECK(bits(r.scores[k]) == bits(want[k]), name);
        CHECK(r.model_version == m["model_version"].get<uint32_t>(), name);
        CHECK(r.server_us == m["server_us"].get<uint32_t>(), name);
        CHECK(r.features_missing == m["features_missing"].get<uint16_t>(), name);
        CHECK(r.error == (m["error"].is_null() ? "" : m["error"].get<std::string>()), name);
        CHECK(r.features_stale == m["features_stale"].get<bool>(), name);
        // Reason codes: the vectors as they are, then per candidate.
        CHECK(quiver::explain_skipped_name(r.explain_skipped) == m["explain_skipped"].get<std::string>(), name);
        CHECK(bits64(r.explain_bias) == bits64(m["explain_bias"].get<double>()), name);
        CHECK(r.explain_candidates == list<uint32_t>(m["explain_candidates"]), name);
        CHECK(r.explain_features == list<uint32_t>(m["explain_features"]), name);
        auto contributions = list<double>(m["explain_contributions"]);
        CHECK(r.explain_contributions.size() == contributions.size(), name);
        for (size_t k = 0; k < contributions.size() && k < r.explain_contributions.size(); k++)
          CHECK(bits64(r.explain_contributions[k]) == bits64(contributions[k]), name);
        auto explained = r.explanations();
        const json none = json::array();
        const json& want_explained = m.contains("explanations") ? m["explanations"] : none;
        CHECK(explained.size() == want_explained.size(), name);
        for (size_t c = 0; c < explained.size() && c < want_explained.size(); c++) {
          const auto& w = want_explained[c];
          CHECK(explained[c].candidate == w["candidate"].get<uint32_t>(), name);
          CHECK(explained[c].top.size() == w["top"].size(), name);
          for (size_t j = 0; j < explained[c].top.size() && j < w["top"].size(); j++) {
            CHECK(explained[c].top[j].first == w["top"][j][0].get<uint32_t>(), name);
            CHECK(bits64(explained[c].top[j].second) == bits64(w["top"][j][1].get<double>()), name);
          }
        }
      }
    } else {
      requests++;
      std::vector<uint8_t> encoded;
      for (const auto& f : doc["frames"]) {
        const auto& m = f["meaning"];
        quiver::Request r;
        r.model = m["model"].is_null() ? "" : m["model"].get<std::string>();
        r.budget_us = m["budget_us"];
        r.priority = m["priority"];
        r.client_id = m["client_id"];
        r.user_id = u64(m["user_id"]);
        r.item_ids = ids(m["item_ids"]);
        if (!m["context"].is_null())
          for (const auto& c : m["context"]) r.context.push_back(static_cast<float>(c.get<double>()));
        r.context_ids = ids(m["context_ids"]);
        if (!m["groups"].is_null()) {
          for (const auto& g : m["groups"]) {
            quiver::GroupKeys k{g["group"], ids(g["ids"]), {}};
            if (!g["keys"].is_null()) k.keys = g["keys"].get<std::vector<std::string>>();
            r.groups.push_back(std::move(k));
          }
        }
        r.explain_top_k = m["explain_top_k"];
        r.explain_candidates_max = m["explain_candidates_max"];
        const uint64_t id = u64(m["request_id"]);
        if (m["server"].get<std::string>().rfind("refused", 0) == 0) {
          // The server refuses it; this client does not even send it.
          CHECK(throws<quiver::InvalidRequest>([&] { quiver::encode_request(r, id); }), name);
          encoded = data;
          break;
        }
        auto frame = quiver::encode_request(r, id);
        encoded.insert(encoded.end(), frame.begin(), frame.end());
      }
      CHECK(encoded == data, name + ": this client's bytes differ from the Rust encoder's");
    }
  }
  CHECK(requests > 0 && responses > 0, "no golden vectors in " + dir.string());
  // Corruption is refused by the verifier, never read out of bounds.
  auto ok = read_bytes(dir / "response_ok.bin");
  std::vector<uint8_t> payload(ok.begin() + 4, ok.end());
  for (size_t n = 0; n < payload.size(); n++) {
    CHECK(throws<quiver::ProtocolError>([&] { quiver::decode_response(payload.data(), n); }), "cut " + std::to_string(n));
  }
  CHECK(throws<quiver::ProtocolError>([] {
          const uint8_t zero[4] = {0, 0, 0, 0};
          quiver::FrameReader().feed(zero, 4);
        }),
        "zero-length frame");
  std::printf("golden vectors: %d request and %d response files, %d failures\n", requests, responses, g_failures);
  return g_failures == 0 ? 0 : 1;
}
