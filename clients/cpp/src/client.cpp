// The blocking client: one non-blocking TCP connection per node, driven by
// poll(2) until a call's answers are in or its time runs out. A batch of
// requests is written whole while answers are read (so neither side's
// socket buffer can fill and stall the other) and matched by request id, in
// whatever order they come.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <unordered_map>

#include "quiver/client.hpp"

namespace quiver {

using Clock = std::chrono::steady_clock;

namespace {

/// Splits "host:port" or "[v6]:port".
std::pair<std::string, std::string> split_addr(const std::string& addr) {
  if (!addr.empty() && addr[0] == '[') {
    auto close = addr.find("]:");
    if (close == std::string::npos) throw std::invalid_argument("node address '" + addr + "' is not [v6]:port");
    return {addr.substr(1, close - 1), addr.substr(close + 2)};
  }
  auto colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == addr.size()) {
    throw std::invalid_argument("node address '" + addr + "' is not host:port");
  }
  return {addr.substr(0, colon), addr.substr(colon + 1)};
}

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

}  // namespace

/// One node's connection.
struct Client::Conn {
  int fd = -1;
  FrameReader reader;

  explicit Conn(size_t frame_bytes_max) : reader(frame_bytes_max) {}
  ~Conn() {
    if (fd >= 0) ::close(fd);
  }
};

Client::Client(std::vector<std::string> nodes, ClientOptions options)
    : nodes_(std::move(nodes)), options_(options), conns_(nodes_.size(), nullptr) {
  if (nodes_.empty()) throw std::invalid_argument("a client needs at least one node");
  for (const auto& n : nodes_) split_addr(n);
  if (options_.timeout.count() <= 0) throw std::invalid_argument("the timeout must be positive");
}

Client::~Client() {
  for (auto* c : conns_) delete c;
}

Response Client::score(const Request& request) { return score_many({request}).front(); }

namespace {

/// Connects to `addr` before `deadline`; the fd, or an error text.
std::optional<int> connect_to(const std::string& addr, Clock::time_point deadline, std::string& why) {
  auto [host, port] = split_addr(addr);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    why = std::string("resolve: ") + ::gai_strerror(rc);
    return std::nullopt;
  }
  std::optional<int> out;
  for (auto* ai = res; ai && !out; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      out = fd;
      break;
    }
    if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int rc = ::poll(&p, 1, ms_left(deadline));
      int err = 0;
      socklen_t len = sizeof err;
      if (rc == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
        out = fd;
        break;
      }
      why = rc == 0 ? "connect: timed out" : std::string("connect: ") + std::strerror(err ? err : errno);
    } else {
      why = std::string("connect: ") + std::strerror(errno);
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

std::vector<Response> Client::score_many(const std::vector<Request>& requests) {
  const auto deadline = Clock::now() + options_.timeout;
  struct Call {
    uint64_t id;
    std::vector<uint8_t> frame;
    std::optional<Response> answer;
  };
  std::vector<Call> calls;
  calls.reserve(requests.size());
  std::unordered_map<uint64_t, size_t> by_id;
  for (const auto& r : requests) {
    // Id 0 is left for the server's frame-level refusals.
    if (next_id_ == 0) next_id_ = 1;
    uint64_t id = next_id_++;
    calls.push_back({id, encode_request(r, id, options_.limits), std::nullopt});
    by_id.emplace(id, calls.size() - 1);
  }
  if (calls.empty()) return {};

  std::vector<std::pair<std::string, std::string>> failures;
  const size_t first = next_node_;
  next_node_ = (next_node_ + 1) % nodes_.size();
  bool reconnect = false;
  for (size_t attempt = 0; attempt < nodes_.size(); attempt++) {
    const size_t node = (first + attempt) % nodes_.size();
    Conn*& conn = conns_[node];
    std::string why;
    // A kept connection the server has closed since (idle timeout, a
    // restart) fails at once: such a node gets one fresh connection.
    const bool kept = conn != nullptr;
    if (!conn) {
      auto fd = connect_to(nodes_[node], deadline, why);
      if (!fd) {
        if (Clock::now() >= deadline) throw TimeoutError(nodes_[node] + ": " + why);
        failures.emplace_back(nodes_[node], why);
        continue;
      }
      conn = new Conn(options_.limits.response_frame_bytes_max);
      conn->fd = *fd;
    }
    // Everything not yet answered goes out on this connection.
    std::vector<uint8_t> out;
    size_t waiting = 0;
    for (const auto& c : calls) {
      if (c.answer) continue;
      out.insert(out.end(), c.frame.begin(), c.frame.end());
      waiting++;
    }
    size_t written = 0;
    bool failed = false;
    while (waiting > 0 && !failed) {
      pollfd p{conn->fd, static_cast<short>(POLLIN | (written < out.size() ? POLLOUT : 0)), 0};
      int rc = ::poll(&p, 1, ms_left(deadline));
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) {
        // Late answers would arrive on the next call: close instead.
        delete conn;
        conn = nullptr;
        throw TimeoutError("no answer to " + std::to_string(waiting) + " of " + std::to_string(calls.size()) +
                           " requests within " + std::to_string(options_.timeout.count()) + " ms");
      }
      if (written < out.size() && (p.revents & POLLOUT)) {
        ssize_t n = ::send(conn->fd, out.data() + written, out.size() - written, MSG_NOSIGNAL);
        if (n < 0 && errno != EAGAIN && errno != EINTR) {
          why = std::string("send: ") + std::strerror(errno);
          failed = true;
          break;
        }
        if (n > 0) written += static_cast<size_t>(n);
      }
      if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
        uint8_t buf[65536];
        ssize_t n = ::recv(conn->fd, buf, sizeof buf, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          why = n == 0 ? "the server closed the connection" : std::string("recv: ") + std::strerror(errno);
          failed = true;
          break;
        }
        if (n < 0) continue;
        std::vector<std::vector<uint8_t>> payloads;
        try {
          payloads = conn->reader.feed(buf, static_cast<size_t>(n));
        } catch (const ProtocolError&) {
          delete conn;
          conn = nullptr;
          throw;
        }
        for (const auto& payload : payloads) {
          Response r;
          try {
            r = decode_response(payload.data(), payload.size());
          } catch (const ProtocolError&) {
            delete conn;
            conn = nullptr;
            throw;
          }
          auto it = by_id.find(r.request_id);
          if (it == by_id.end() || calls[it->second].answer) {
            if (r.request_id == 0 && r.status == Status::BadRequest) {
              why = "the server refused a frame: " + r.error;
              failed = true;
              break;
            }
            delete conn;
            conn = nullptr;
            throw ProtocolError("an answer to request " + std::to_string(r.request_id) + ", which was not sent here");
          }
          calls[it->second].answer = std::move(r);
          waiting--;
        }
      }
    }
    if (!failed) {
      std::vector<Response> answers;
      answers.reserve(calls.size());
      for (auto& c : calls) answers.push_back(std::move(*c.answer));
      if (options_.check) {
        for (auto& a : answers) {
          if (a.status != Status::Ok) throw_for(a);
        }
      }
      return answers;
    }
    delete conn;
    conn = nullptr;
    if (kept && !reconnect) {
      reconnect = true;
      attempt--;
      continue;
    }
    reconnect = false;
    failures.emplace_back(nodes_[node], why);
    if (Clock::now() >= deadline) break;
  }
  std::string all;
  for (const auto& [node, why] : failures) all += (all.empty() ? "" : "; ") + node + ": " + why;
  throw ConnectionError(failures.size() == 1 ? all : "every node failed: " + all);
}

}  // namespace quiver
