// The client against real `quiver serve` processes started here (stopped
// by PID): scores equal the Rust client's (`quiver score --json`) bit for
// bit, 1,000 requests pipelined on one connection, typed errors, client-side
// limits, a timeout against a server that never answers, failover past dead
// and killed nodes, and reason codes (explain_top_k) equal to the Rust
// client's.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "check.hpp"
#include "quiver/client.hpp"

using namespace std::chrono_literals;
namespace fs = std::filesystem;

static std::string quiver_bin() {
  const char* env = std::getenv("QUIVER_BIN");
  std::string bin = env ? env : QUIVER_DEFAULT_BIN;
  if (!fs::exists(bin)) {
    std::fprintf(stderr, "%s does not exist: run `cargo build --release` or set QUIVER_BIN\n", bin.c_str());
    std::exit(1);
  }
  return bin;
}

static std::string run(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

/// `quiver serve` on a free port, one shard; killed by PID when done.
struct Server {
  pid_t pid = -1;
  std::string addr;

  Server(const std::string& data, const std::vector<std::string>& extra = {}) {
    int out[2];
    if (::pipe(out) != 0) std::abort();
    pid = ::fork();
    if (pid == 0) {
      ::dup2(out[1], 1);
      ::close(out[0]);
      // Its log would bury the test's own output; a start that fails shows
      // as no "listening" line.
      int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 2);
      std::vector<std::string> args = {quiver_bin(), "serve", "--data-dir", data, "--listen", "127.0.0.1:0",
                                       "--admin", "127.0.0.1:0", "--shards", "1"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      std::_Exit(127);
    }
    ::close(out[1]);
    FILE* f = ::fdopen(out[0], "r");
    char line[512];
    while (std::fgets(line, sizeof line, f)) {
      std::string l(line);
      const std::string tag = "quiver listening on ";
      if (l.rfind(tag, 0) == 0) {
        addr = l.substr(tag.size());
        addr = addr.substr(0, addr.find_first_of(" \n"));
        break;
      }
    }
    // Keep draining its stdout so the pipe never fills.
    std::thread([f] {
      char sink[512];
      while (std::fgets(sink, sizeof sink, f)) {
      }
      std::fclose(f);
    }).detach();
    if (addr.empty()) {
      std::fprintf(stderr, "quiver serve did not start\n");
      std::exit(1);
    }
  }
  void kill(int sig = SIGKILL) {
    if (pid > 0) {
      ::kill(pid, sig);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
  ~Server() { kill(SIGTERM); }
};

/// A listening socket that never accepts or answers; and a closed port.
static std::pair<int, std::string> silent_listener() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::listen(fd, 16);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return {fd, "127.0.0.1:" + std::to_string(ntohs(a.sin_port))};
}

static std::string dead_addr() {
  auto [fd, addr] = silent_listener();
  ::close(fd);
  return addr;
}

static quiver::Request demo_request(int i) {
  quiver::Request r;
  r.user_id = static_cast<uint64_t>((i * 7919 + 13) % 100000);
  for (int k = 0; k < 32; k++) r.item_ids.push_back(static_cast<uint64_t>((i * 131 + k * 977) % 10000));
  for (int k = 0; k < 16; k++) r.context.push_back(static_cast<float>((i + k) % 7) * 0.3f - 0.9f);
  r.budget_us = 1000000;
  return r;
}

static uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

int main() {
  ::signal(SIGPIPE, SIG_IGN);
  const std::string bin = quiver_bin();
  const std::string data = (fs::temp_directory_path() / ("quiver-cpp-demo-" + std::to_string(::getpid()))).string();
  run(bin + " demo --data-dir " + data + " 2>/dev/null");
  Server server(data);
  quiver::ClientOptions opts;
  opts.timeout = 10s;

  {  // Bit for bit the Rust client's scores.
    quiver::Client c({server.addr}, opts);
    for (int i : {0, 7, 42}) {
      auto req = demo_request(i);
      auto r = c.score(req);
      std::string items, context;
      for (auto id : req.item_ids) items += (items.empty() ? "" : ",") + std::to_string(id);
      for (float x : req.context) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(x));
        context += (context.empty() ? "" : ",") + std::string(buf);
      }
      auto out = run(bin + " score --addr " + server.addr + " --json --user " + std::to_string(req.user_id) +
                     " --items " + items + " --budget-us 1000000 --context=" + context);
      auto rust = nlohmann::json::parse(out);
      CHECK(r.scores.size() == 32 && rust["scores"].size() == 32, "score count");
      for (size_t k = 0; k < r.scores.size() && k < rust["scores"].size(); k++) {
        CHECK(bits(r.scores[k]) == bits(static_cast<float>(rust["scores"][k].get<double>())), "score " + std::to_string(k));
      }
      CHECK(r.status == quiver::Status::Ok && r.tier == quiver::Tier::Primary && r.reason == quiver::Reason::None);
      CHECK(r.model_version == rust["model_version"].get<uint32_t>());
    }
  }

  {  // 1,000 pipelined on one connection: each its own answer.
    quiver::Client c({server.addr}, opts);
    std::vector<quiver::Response> singles;
    for (int i = 0; i < 20; i++) singles.push_back(c.score(demo_request(i)));
    std::vector<quiver::Request> many;
    for (int i = 0; i < 1000; i++) many.push_back(demo_request(i % 20));
    auto answers = c.score_many(many);
    CHECK(answers.size() == 1000);
    for (size_t i = 0; i < answers.size(); i++) {
      for (size_t k = 0; k < 32; k++) CHECK(bits(answers[i].scores[k]) == bits(singles[i % 20].scores[k]));
    }
  }

  {  // Typed errors; the connection goes on after them.
    quiver::Client c({server.addr}, opts);
    auto bad_model = demo_request(1);
    bad_model.model = "no-such-model";
    CHECK(throws<quiver::ModelNotFound>([&] { c.score(bad_model); }), "ModelNotFound");
    auto bad_context = demo_request(1);
    bad_context.context = {1, 2, 3};
    try {
      c.score(bad_context);
      CHECK(false, "BadRequest expected");
    } catch (const quiver::BadRequest& e) {
      CHECK(e.response.error.find("context has 3 floats") != std::string::npos, e.response.error);
    }
    CHECK(c.score(demo_request(2)).status == quiver::Status::Ok);
    quiver::ClientOptions raw = opts;
    raw.check = false;
    quiver::Client unchecked({server.addr}, raw);
    CHECK(unchecked.score(bad_context).status == quiver::Status::BadRequest);
  }

  {  // Client-side limits: nothing is sent.
    quiver::Client c({dead_addr()}, opts);
    quiver::Request too_many;
    for (uint64_t i = 0; i < 257; i++) too_many.item_ids.push_back(i);
    CHECK(throws<quiver::InvalidRequest>([&] { c.score(too_many); }), "257 candidates");
    CHECK(throws<quiver::InvalidRequest>([&] { c.score(quiver::Request{}); }), "no candidates");
    quiver::Request long_key;
    long_key.groups.push_back({"device", {}, {std::string(65, 'x')}});
    CHECK(throws<quiver::InvalidRequest>([&] { c.score(long_key); }), "65-byte key");
  }

  {  // A server that never answers: a timeout, on time.
    auto [fd, addr] = silent_listener();
    quiver::ClientOptions quick = opts;
    quick.timeout = 200ms;
    quiver::Client c({addr}, quick);
    auto t0 = std::chrono::steady_clock::now();
    CHECK(throws<quiver::TimeoutError>([&] { c.score(demo_request(1)); }), "timeout");
    CHECK(std::chrono::steady_clock::now() - t0 >= 190ms, "timed out early");
    ::close(fd);
  }

  {  // Dead nodes are skipped; all dead is a ConnectionError.
    quiver::Client c({dead_addr(), server.addr}, opts);
    for (int i = 0; i < 10; i++) CHECK(c.score(demo_request(i)).status == quiver::Status::Ok);
    quiver::Client none({dead_addr(), dead_addr()}, opts);
    CHECK(throws<quiver::ConnectionError>([&] { none.score(demo_request(1)); }), "all dead");
  }

  {  // A node killed: between calls (its kept connection fails, the next
     // node answers) and during a pipelined batch (best effort: whatever
     // the kill cut off is sent again).
    Server victim(data, {"--inference", "thread"});
    quiver::Client c({victim.addr, server.addr}, opts);
    CHECK(c.score(demo_request(1)).status == quiver::Status::Ok);  // victim
    CHECK(c.score(demo_request(2)).status == quiver::Status::Ok);  // server
    victim.kill();
    CHECK(c.score(demo_request(3)).status == quiver::Status::Ok);  // victim's turn: fails over
    Server victim2(data, {"--inference", "thread"});
    quiver::Client d({victim2.addr, server.addr}, opts);
    std::vector<quiver::Request> batch;
    for (int i = 0; i < 3000; i++) batch.push_back(demo_request(i % 20));
    std::thread killer([&] {
      std::this_thread::sleep_for(5ms);
      victim2.kill();
    });
    auto answers = d.score_many(batch);
    killer.join();
    CHECK(answers.size() == batch.size());
    for (const auto& a : answers) CHECK(a.status == quiver::Status::Ok);
  }

  {  // Reason codes: an MLP cannot be explained, and says so with its
     // scores; the fraud example's LightGBM model explains, bit for bit
     // what the Rust client (`quiver score --explain --json`) returns.
    quiver::Client c({server.addr}, opts);
    auto mlp = demo_request(3);
    mlp.explain_top_k = 3;
    mlp.explain_candidates_max = 2;
    auto r = c.score(mlp);
    CHECK(r.status == quiver::Status::Ok && r.scores.size() == 32, "scores despite no reasons");
    CHECK(r.explain_skipped == quiver::ExplainSkipped::NotExplainable, quiver::explain_skipped_name(r.explain_skipped));
    CHECK(r.explanations().empty());
    auto too_many = demo_request(3);
    too_many.explain_top_k = 33;
    CHECK(throws<quiver::InvalidRequest>([&] { c.score(too_many); }), "explain_top_k 33");
    too_many.explain_top_k = 1;
    too_many.item_ids.resize(65, 1);
    CHECK(throws<quiver::InvalidRequest>([&] { c.score(too_many); }), "65 candidates to explain");
    too_many.explain_candidates_max = 64;
    CHECK(c.score(too_many).explain_skipped == quiver::ExplainSkipped::NotExplainable, "64 of 65 asked");

    const std::string fraud_data = data + "-fraud";
    run(bin + " demo --workload fraud --data-dir " + fraud_data + " 2>/dev/null");
    Server fraud(fraud_data, {"--demo", "--workload", "fraud"});
    quiver::Client f({fraud.addr}, opts);
    quiver::Request q;
    q.groups = {{"card", {42}, {}},
                {"account", {7}, {}},
                {"device", {}, {"26c3cb25dcc2fec7"}},
                {"ip", {}, {"27.191.142.146"}},
                {"merchant", {5}, {}}};
    q.context = {250.0f, 3.0f};
    q.budget_us = 1000000;
    q.explain_top_k = 5;
    auto got = f.score(q);
    CHECK(got.status == quiver::Status::Ok && got.tier == quiver::Tier::Primary, got.error);
    CHECK(got.explain_skipped == quiver::ExplainSkipped::None, quiver::explain_skipped_name(got.explain_skipped));
    auto out = run(bin + " score --addr " + fraud.addr +
                   " --json --key card=42 --key account=7 --str-key device=26c3cb25dcc2fec7"
                   " --key ip=27.191.142.146 --key merchant=5 --context 250,3 --budget-us 1000000 --explain 5"
                   " --admin 127.0.0.1:1 2>/dev/null");
    auto rust = nlohmann::json::parse(out);
    auto explained = got.explanations();
    CHECK(explained.size() == 1 && rust["explanations"].size() == 1, out);
    if (explained.size() == 1 && rust["explanations"].size() == 1) {
      const auto& want = rust["explanations"][0];
      CHECK(explained[0].candidate == want["candidate"].get<uint32_t>());
      CHECK(got.explain_bias == want["bias"].get<double>(), "bias");
      CHECK(explained[0].top.size() == 5 && want["top"].size() == 5, out);
      for (size_t j = 0; j < explained[0].top.size() && j < want["top"].size(); j++) {
        CHECK(explained[0].top[j].first == want["top"][j]["index"].get<uint32_t>(), "feature " + std::to_string(j));
        CHECK(explained[0].top[j].second == want["top"][j]["contribution"].get<double>(), "contribution");
      }
    }
    fraud.kill(SIGTERM);
    fs::remove_all(fraud_data);
  }

  fs::remove_all(data);
  std::printf("server tests: %d failures\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
