// Closed-loop driver of the Node.js client for bench/clients_overhead.sh:
// INFLIGHT async loops keep that many requests outstanding on one
// connection for DURATION_S; prints one JSON object: the rate and the
// per-request latency percentiles (send to answer, µs).
//
// usage: node node_driver.mjs ADDR INFLIGHT DURATION_S   (after `npm run build` in clients/node)
import { Client } from "../../clients/node/dist/src/index.js";

const [addr, inflightArg, durationArg] = process.argv.slice(2);
const inflight = Number(inflightArg);
const durationNs = BigInt(Math.round(Number(durationArg) * 1e9));
const request = {
  userId: 42,
  itemIds: Array.from({ length: 32 }, (_, i) => i + 1),
  context: new Array(16).fill(0.25),
  budgetUs: 100_000,
};
const c = new Client(addr, { timeoutMs: 5000 });
for (let i = 0; i < 200; i++) await c.score(request);
const lat = [];
const t0 = process.hrtime.bigint();
const end = t0 + durationNs;
async function slot() {
  for (;;) {
    const s = process.hrtime.bigint();
    if (s >= end) return;
    await c.score(request);
    lat.push(Number(process.hrtime.bigint() - s));
  }
}
await Promise.all(Array.from({ length: inflight }, slot));
const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
await c.close();
lat.sort((a, b) => a - b);
const pick = (p) => lat[Math.min(lat.length - 1, Math.floor(p * lat.length))] / 1000;
console.log(JSON.stringify({
  client: "node", inflight, requests: lat.length, seconds, rate: lat.length / seconds,
  p50_us: pick(0.5), p99_us: pick(0.99), p999_us: pick(0.999), max_us: lat[lat.length - 1] / 1000,
}));
