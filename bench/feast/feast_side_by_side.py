#!/usr/bin/env python3
"""Feast's own serving beside Quiver serving the same Feast repository (issue 35).

One run, one machine, the same entities: the repository tests/feast.rs
serves (bench/feast/feast_repo.py build: pinned feast, a Redis online store
on a redis-server this script starts, --users users, 100 features over five
views: the four of the service `scoring` the requests read, and a view of
(user, merchant) pairs, which the first sync copies too) and the LightGBM model `feast_repo.py train` fits on it. Each request
is one user, one merchant and 32 items, drawn with a fixed seed:

- Feast's Python SDK: one `FeatureStore.get_online_features` call over the
  feature service `scoring` with 32 entity rows (user, item, merchant);
- `feast serve` over HTTP: the same as one POST /get-online-features on a
  kept-alive connection;
- Quiver, scoring: one request through the Python client (clients/python)
  to a `quiver serve` whose only features are `[feast]`'s views, the model
  on top (user_stats, user_recent and merchant_risk once, item_attrs per
  candidate: 35 rows);
- Quiver, lookup: the server's own timer of its lookup stage (the 35 rows
  read from the replicas into the model's input), over the scoring run's
  last ten seconds (`/stats.json`'s window).

Each is paced at a fixed --rate for --duration seconds, one caller, and a
call's latency runs from the time it was due (a late call's wait counts).
Also: the first sync's rate (`quiver feast sync` of every entity into fresh
files, wall time, --sync-runs runs, median) and the lag from a Feast write
(`store.push` to the online store) to the served row (polled on the admin
route; from the push's return, and the push call itself).

A tree with uncommitted changes is refused: the figures name the commit
they measured. Run from the repository root after `cargo build --release`
(python3 re-runs itself in the feast virtual environment, which gets the
Python client's pinned flatbuffers):

    python3 bench/feast/feast_side_by_side.py [--venv target/feast-venv] [--users 10000] \\
        [--rate 10] [--duration 60]

Writes bench/results/feast_side_by_side.json and .md (rendered into
docs/BENCHMARKS.md by bench/report.py) and prints the latter.
"""

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
QUIVER = ROOT / "target" / "release" / "quiver"
FLATBUFFERS_PIN = "25.12.19"
ITEMS = 32


def in_venv(args):
    """Re-runs this script under the venv's python (feast, lightgbm and the
    client's flatbuffers installed) unless it is that python."""
    sys.path.insert(0, str(HERE))
    import feast_repo

    venv_dir = Path(args.venv).resolve()
    python = feast_repo.ensure_feast(venv_dir)
    probe = subprocess.run([python, "-c", "import flatbuffers; print(flatbuffers.__version__)"], capture_output=True, text=True)
    if probe.stdout.strip() != FLATBUFFERS_PIN:
        subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"flatbuffers=={FLATBUFFERS_PIN}"],
            check=True,
        )
    if Path(sys.prefix).resolve() != venv_dir:
        os.execv(python, [str(python), __file__, *sys.argv[1:]])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what, ready, seconds=120):
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit(f"feast_side_by_side: {what} was not ready within {seconds} s")


def http_get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def percentiles(lat_us):
    s = sorted(lat_us)

    def q(p):
        return round(s[min(len(s) - 1, int(p * len(s)))], 1)

    return {"n": len(s), "p50_us": q(0.5), "p99_us": q(0.99), "p999_us": q(0.999)}


def paced(rate, duration_s, call, warmup=20):
    """`call(k)` at `rate` per second for `duration_s`: the percentiles of
    each call's latency from the time it was due, in microseconds, with
    those of the call alone (`service_*`) and the rate it kept."""
    for k in range(warmup):
        call(k)
    n = int(rate * duration_s)
    start = time.perf_counter() + 0.05
    lat, service = [], []
    for k in range(n):
        due = start + k / rate
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        began = time.perf_counter()
        call(k)
        done = time.perf_counter()
        lat.append((done - due) * 1e6)
        service.append((done - began) * 1e6)
    out = percentiles(lat)
    out.update({f"service_{k}": v for k, v in percentiles(service).items() if k != "n"})
    out["kept_per_s"] = round(n / (time.perf_counter() - start), 1)
    return out


def cpu_model():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=str(ROOT / "target" / "feast-venv"))
    ap.add_argument("--users", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=10.0, help="calls per second, each system")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per system")
    ap.add_argument("--sync-runs", type=int, default=3)
    ap.add_argument("--lag-samples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    in_venv(args)
    load_start = os.getloadavg()
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    sys.path.insert(0, str(HERE))
    import feast_repo
    import pandas as pd
    from provenance import git_commit, write_results
    from quiver_client import Client

    if not QUIVER.exists():
        sys.exit(f"{QUIVER} is missing: run cargo build --release first")
    commit = git_commit()
    if commit.endswith("+dirty") or commit == "unknown":
        sys.exit(f"feast_side_by_side: the tree is {commit}: commit first, so the figures name what they measured")
    work = Path(tempfile.mkdtemp(prefix="quiver-feast-bench-"))
    procs = []
    try:
        redis_port = free_port()
        procs.append(
            subprocess.Popen(
                ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL,
                cwd=work,
            )
        )
        wait_until("redis-server", lambda: socket.create_connection(("127.0.0.1", redis_port), 1).close() is None)
        repo = work / "repo"
        script = str(HERE / "feast_repo.py")
        common = ["--venv", args.venv, "--repo", str(repo)]
        subprocess.run(
            [sys.executable, script, "build", *common, "--redis-port", str(redis_port), "--users", str(args.users)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        model_txt, expected = work / "model.txt", work / "expected.json"
        subprocess.run(
            [sys.executable, script, "train", *common, "--users", str(args.users), "--requests", "1"]
            + ["--model", str(model_txt), "--out", str(expected)],
            check=True,
        )
        inputs = json.loads(expected.read_text())["inputs"]

        # The first sync: every entity into fresh files, timed whole.
        sync = []
        for run in range(args.sync_runs):
            data = work / f"sync{run}"
            began = time.perf_counter()
            out = subprocess.run(
                [QUIVER, "feast", "sync", "--repo", str(repo), "--data-dir", str(data)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            wall_s = time.perf_counter() - began
            keys = int(out.split(" keys scanned")[0].split()[-1])
            sync.append({"keys": keys, "wall_s": round(wall_s, 3), "entities_per_s": round(keys / wall_s)})
        data = work / f"sync{args.sync_runs - 1}"
        subprocess.run(
            [QUIVER, "import", "--lightgbm", str(model_txt), "--out", str(data / "model.qm"), "--name", "feast_demo"]
            + ["--version", "1", "--inputs", inputs],
            check=True,
            capture_output=True,
        )
        config = data / "quiver.toml"
        config.write_text(f'[feast]\nrepo = "{repo}"\ncandidate = ["item_attrs"]\n')
        listen, admin = free_port(), free_port()
        procs.append(
            subprocess.Popen(
                [QUIVER, "serve", "--config", str(config), "--data-dir", str(data)]
                + ["--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}"],
                stdout=subprocess.DEVNULL,
                stderr=open(work / "quiver.log", "w"),
            )
        )
        wait_until("quiver serve", lambda: "quiver_feast_connected 1" in http_get(f"http://127.0.0.1:{admin}/metrics"))
        feast_port = free_port()
        feast_bin = Path(sys.executable).with_name("feast")
        procs.append(
            subprocess.Popen(
                [feast_bin, "serve", "-h", "127.0.0.1", "-p", str(feast_port)],
                cwd=repo,
                env=dict(os.environ, FEAST_USAGE="False"),
                stdout=subprocess.DEVNULL,
                stderr=open(work / "feast_serve.log", "w"),
            )
        )
        wait_until("feast serve", lambda: http.client.HTTPConnection("127.0.0.1", feast_port, timeout=2).request("GET", "/health") is None)

        keys = feast_repo.entities(args.users)
        rng = random.Random(args.seed)
        requests = [
            (rng.choice(keys["user_id"]), rng.choice(keys["merchant_id"]), rng.sample(keys["item_id"], ITEMS))
            for _ in range(500)
        ]
        from feast import FeatureStore

        store = FeatureStore(repo_path=str(repo))
        service = store.get_feature_service("scoring")

        def sdk(k):
            user, merchant, items = requests[k % len(requests)]
            rows = [{"user_id": user, "item_id": i, "merchant_id": merchant} for i in items]
            store.get_online_features(features=service, entity_rows=rows).to_dict()

        conn = http.client.HTTPConnection("127.0.0.1", feast_port, timeout=10)

        def feast_http(k):
            user, merchant, items = requests[k % len(requests)]
            body = json.dumps(
                {
                    "feature_service": "scoring",
                    "entities": {"user_id": [user] * ITEMS, "item_id": items, "merchant_id": [merchant] * ITEMS},
                }
            )
            conn.request("POST", "/get-online-features", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                sys.exit(f"feast serve answered {r.status}")

        client = Client(f"127.0.0.1:{listen}", timeout=5)

        def quiver(k):
            user, merchant, items = requests[k % len(requests)]
            client.score(
                groups={"user_stats": user, "user_recent": user, "merchant_risk": merchant, "item_attrs": items}
            )

        latency = {}
        for name, call in [("feast_sdk", sdk), ("feast_serve_http", feast_http), ("quiver_score", quiver)]:
            latency[name] = paced(args.rate, args.duration, call)
        stats = json.loads(http_get(f"http://127.0.0.1:{admin}/stats.json"))
        stage = {s["stage"]: s for s in stats["stages"]}
        lookup = stage["lookup"]
        latency["quiver_lookup_stage"] = {
            "n": lookup["count"],
            "p50_us": lookup["p50_us"],
            "p99_us": lookup["p99_us"],
            "p999_us": lookup["p999_us"],
        }

        # The lag from a Feast write (a push to the online store) to the row served.
        sys.path.insert(0, str(repo))
        from definitions import COLUMNS
        from feast.data_source import PushMode

        columns = COLUMNS["user_stats"]
        served = next(p for p in service.feature_view_projections if p.name == "user_stats")
        at = [f.name for f in served.features].index("us_f32_0")
        push_us, lag_us = [], []
        for j in range(args.lag_samples):
            user = keys["user_id"][j % len(keys["user_id"])]
            frame = {"user_id": [user], **feast_repo.changed_rows(columns, 1, args.seed + j)}
            marker = float(2_000_000 + j)
            frame["us_f32_0"] = pd.array([marker], dtype="Float32")
            df = pd.DataFrame(frame)
            now = pd.Timestamp.now(tz="UTC")
            df["event_timestamp"] = now + pd.Timedelta(hours=1, seconds=j)
            df["created"] = now
            began = time.perf_counter()
            store.push("user_stats_push", df, to=PushMode.ONLINE)
            pushed = time.perf_counter()
            url = f"http://127.0.0.1:{admin}/features/user_stats?key={user}"
            while json.loads(http_get(url))["row"][at] != marker:
                if time.perf_counter() - pushed > 10:
                    sys.exit(f"feast_side_by_side: a push was not served within 10 s (user {user})")
            lag_us.append((time.perf_counter() - pushed) * 1e6)
            push_us.append((pushed - began) * 1e6)
        lag = {"push_call": percentiles(push_us), "push_return_to_served": percentiles(lag_us)}
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    import feast

    report = {
        "commit": commit,
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count()},
        "feast": feast.__version__,
        "users": args.users,
        "rate_per_s": args.rate,
        "duration_s": args.duration,
        "items_per_request": ITEMS,
        "latency": latency,
        "first_sync": sync,
        "lag": lag,
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
    }
    load = " ".join(f"{x:.2f}" for x in load_start), " ".join(f"{x:.2f}" for x in report["load_average_end"])
    med_rate = statistics.median(s["entities_per_s"] for s in sync)
    rows = [
        ("Feast SDK `get_online_features` (service, 32 entity rows)", "feast_sdk"),
        ("`feast serve` POST /get-online-features (kept-alive HTTP)", "feast_serve_http"),
        ("Quiver scoring call (Python client, 35 rows + LightGBM)", "quiver_score"),
        ("Quiver lookup stage, in the server (35 rows)", "quiver_lookup_stage"),
    ]
    def row(label, key):
        r = latency[key]
        kept = f"{r['kept_per_s']:g}" if "kept_per_s" in r else "-"
        service = f"{r['service_p50_us']:.0f}" if "service_p50_us" in r else "-"
        return f"| {label} | {r['n']} | {kept} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['p999_us']:.0f} | {service} |"

    table = "\n".join(row(label, key) for label, key in rows)
    md = f"""## Feast's serving beside Quiver on the same Feast repository

`python3 bench/feast/feast_side_by_side.py --users {args.users} --rate {args.rate:g} --duration {args.duration:g}`
at `{commit}`, feast {feast.__version__}, on {cpu_model()} ({os.cpu_count()} vCPUs; load average
(1, 5, 15 min) {load[0]} at start, {load[1]} at end: read the figures as one run's, not as bounds). One request is a
user, a merchant and {ITEMS} items of the bench repository ({args.users} users, 92 features over four
views, Redis online store on 127.0.0.1); each system is called by one caller at {args.rate:g} calls/s for
{args.duration:g} s, a call's latency from the time it was due (so a system that cannot keep the rate
shows its queue: "kept" is the rate it managed; "alone" the call's own p50, without the wait). The
lookup stage is the server's own timer over the scoring run's last ten seconds. With n calls, p99.9
is the largest few.

| call | n | kept /s | p50 µs | p99 µs | p99.9 µs | alone p50 µs |
|---|---:|---:|---:|---:|---:|---:|
{table}

First sync (`quiver feast sync`, every entity into fresh files, wall time): median
{med_rate:,.0f} entities/s over {len(sync)} runs ({", ".join(f"{s['keys']} keys in {s['wall_s']} s" for s in sync)}).

Lag from a Feast write to the served row ({args.lag_samples} pushes of one user's `user_stats` through
`store.push(..., to=PushMode.ONLINE)`, the row polled on the admin route): from the push's return, p50
{lag['push_return_to_served']['p50_us']:.0f} µs, p99 {lag['push_return_to_served']['p99_us']:.0f} µs; the push call itself p50
{lag['push_call']['p50_us']:.0f} µs, p99 {lag['push_call']['p99_us']:.0f} µs.
"""
    write_results(args.results, "feast_side_by_side", report, md)


if __name__ == "__main__":
    main()
