// Closed-loop driver of the C++ client for bench/clients_overhead.sh: for
// DURATION_S, one request at a time (INFLIGHT 1) or batches of INFLIGHT
// pipelined on one connection (score_many: the batch is written whole, then
// every answer read, so a request's latency is its batch's); prints one JSON
// object: the rate and the per-request latency percentiles (µs).
//
// usage: bench_client ADDR INFLIGHT DURATION_S
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "quiver/client.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: bench_client ADDR INFLIGHT DURATION_S\n");
    return 2;
  }
  using Clock = std::chrono::steady_clock;
  const std::string addr = argv[1];
  const size_t inflight = std::strtoul(argv[2], nullptr, 10);
  const auto duration = std::chrono::duration<double>(std::strtod(argv[3], nullptr));
  quiver::ClientOptions opts;
  opts.timeout = std::chrono::milliseconds(5000);
  quiver::Client c({addr}, opts);
  quiver::Request r;
  r.user_id = 42;
  for (uint64_t i = 1; i <= 32; i++) r.item_ids.push_back(i);
  r.context.assign(16, 0.25f);
  r.budget_us = 100000;
  const std::vector<quiver::Request> batch(inflight, r);
  for (int i = 0; i < 200; i++) c.score(r);
  std::vector<double> lat_us;
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::duration_cast<Clock::duration>(duration);
  while (Clock::now() < end) {
    const auto s = Clock::now();
    if (inflight == 1) {
      c.score(r);
    } else {
      c.score_many(batch);
    }
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - s).count();
    lat_us.insert(lat_us.end(), inflight, us);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::sort(lat_us.begin(), lat_us.end());
  auto pick = [&](double p) { return lat_us[std::min(lat_us.size() - 1, static_cast<size_t>(p * lat_us.size()))]; };
  std::printf(
      "{\"client\": \"cpp\", \"inflight\": %zu, \"requests\": %zu, \"seconds\": %.3f, \"rate\": %.1f, "
      "\"p50_us\": %.1f, \"p99_us\": %.1f, \"p999_us\": %.1f, \"max_us\": %.1f}\n",
      inflight, lat_us.size(), seconds, lat_us.size() / seconds, pick(0.5), pick(0.99), pick(0.999), lat_us.back());
  return 0;
}
