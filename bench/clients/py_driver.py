#!/usr/bin/env python3
"""Closed-loop driver of the Python client for bench/clients_overhead.sh:
keeps INFLIGHT requests outstanding on one connection for DURATION_S and
prints one JSON object: the rate and the per-request latency percentiles
(send to answer, µs). One in flight uses the blocking client; more use the
asyncio client with one task per slot (its pipelining).

usage: py_driver.py ADDR INFLIGHT DURATION_S
"""

import asyncio
import json
import sys
import time

import quiver_client as q

REQUEST = q.Request(user_id=42, item_ids=list(range(1, 33)), context=[0.25] * 16, budget_us=100_000)


def summary(lat_ns, seconds):
    lat_ns.sort()
    pick = lambda p: lat_ns[min(len(lat_ns) - 1, int(p * len(lat_ns)))] / 1000.0
    return {"client": "python", "requests": len(lat_ns), "seconds": seconds, "rate": len(lat_ns) / seconds,
            "p50_us": pick(0.50), "p99_us": pick(0.99), "p999_us": pick(0.999), "max_us": lat_ns[-1] / 1000.0}


def blocking(addr, duration_s):
    lat = []
    with q.Client(addr, timeout=5.0) as c:
        for _ in range(200):
            c.score(REQUEST)
        t0 = time.perf_counter_ns()
        end = t0 + int(duration_s * 1e9)
        while True:
            s = time.perf_counter_ns()
            if s >= end:
                break
            c.score(REQUEST)
            lat.append(time.perf_counter_ns() - s)
        return summary(lat, (time.perf_counter_ns() - t0) / 1e9)


async def pipelined(addr, inflight, duration_s):
    lat = []
    async with q.AsyncClient(addr, timeout=5.0) as c:
        for _ in range(200):
            await c.score(REQUEST)
        t0 = time.perf_counter_ns()
        end = t0 + int(duration_s * 1e9)

        async def slot():
            while True:
                s = time.perf_counter_ns()
                if s >= end:
                    return
                await c.score(REQUEST)
                lat.append(time.perf_counter_ns() - s)

        await asyncio.gather(*(slot() for _ in range(inflight)))
        return summary(lat, (time.perf_counter_ns() - t0) / 1e9)


def main():
    addr, inflight, duration_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    out = blocking(addr, duration_s) if inflight == 1 else asyncio.run(pipelined(addr, inflight, duration_s))
    out["inflight"] = inflight
    print(json.dumps(out))


if __name__ == "__main__":
    main()
