#!/usr/bin/env python3
"""Builds the Feast repository Quiver's Feast tests serve, and fills its Redis.

    python3 bench/feast/feast_repo.py build --venv DIR --repo DIR (--redis-port P | --redis-cluster H:P,H:P...) \
        [--users N] [--seed S] [--entity-key-serialization-version 3]
    python3 bench/feast/feast_repo.py online --venv DIR --repo DIR --out FILE.json \
        [--users N]
    python3 bench/feast/feast_repo.py train --venv DIR --repo DIR --model FILE.txt --out FILE.json \
        [--users N] [--requests R]
    python3 bench/feast/feast_repo.py venv --venv DIR

`build` makes the virtual environment DIR with the pinned feast (and its
Redis extra, and the pinned lightgbm `train` uses) unless it already has that version, writes a fresh repository
at --repo (repo/definitions.py beside this script, a feature_store.yaml
naming a file registry and the Redis online store on 127.0.0.1:P (or, with
--redis-cluster, a Redis Cluster through those nodes: `redis_type:
redis_cluster`), and one
parquet file per feature view written from a seeded generator), then runs
`feast apply` and `feast materialize` over the window that holds every row.

`online` asks that repository's `FeatureStore.get_online_features` for the
feature services `scoring` and `pairs` and every entity `build` wrote, and
writes what it returned converted to f32 (float, double, int32, int64 as the
nearest f32; bool as 1 or 0; null or absent as null) as JSON: {"views":
{view: {"key": join keys, "features": [...], "rows": {key: [f32 or null,
...]}}}}, each row under the key Quiver serves it by (`key_text`: the
join key's value, or for user_merchant's composite key the values' canonical
text). It is what tests/feast.rs compares Quiver's served rows with, value
for value.

`update` writes new rows for the first --count users of user_recent into
its parquet file (event times two minutes ahead, past what `build`
materialized) and runs `feast materialize-incremental`; `push` pushes new
rows for the first --count entities of --view (user_stats, or the composite
user_merchant) through its push source `<view>_push` (online). Each then writes, as `online` does, what
`get_online_features` returns for those users afterwards (--out): what
tests/feast.rs waits for Quiver to serve.

`train` fits a LightGBM model on the offline store's features
(`get_historical_features` over the feature service) and writes, for a few
requests of a user, a merchant and 32 items, what it predicts on the values
`get_online_features` returns (see its docstring): what tests/feast.rs
compares Quiver's scores with, and the README's walkthrough runs.

`venv` only makes the virtual environment (what .ci/run does before the
tests, which then find it through QUIVER_FEAST_VENV).

The repository's generated files (data/, registry.db) are not kept in git:
this script makes them again, the same for the same --seed.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

FEAST_PIN = "0.67.0"
# The model `train` fits on Feast's features: the pin .ci/run's tree
# fixtures use, installed beside feast.
LIGHTGBM_PIN = "4.7.0"
HERE = Path(__file__).resolve().parent
PROJECT = "quiver_feast"

# Each view's share of entities with a null in a given column, and the
# columns that are null for every row of some entities (an absent feature).
NULL_SHARE = 0.05


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def ensure_feast(venv_dir: Path) -> Path:
    """The venv's python, with feast FEAST_PIN installed in it."""
    python = venv_python(venv_dir)
    if not python.exists():
        print(f"feast_repo: creating {venv_dir}", file=sys.stderr)
        venv.create(venv_dir, with_pip=True)
    probe = subprocess.run(
        [python, "-c", "import feast, redis, lightgbm; print(feast.__version__, lightgbm.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 or probe.stdout.strip() != f"{FEAST_PIN} {LIGHTGBM_PIN}":
        pins = [f"feast[redis]=={FEAST_PIN}", f"lightgbm=={LIGHTGBM_PIN}"]
        print(f"feast_repo: installing {' '.join(pins)} into {venv_dir}", file=sys.stderr)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins], check=True)
    return python


def in_venv(args: argparse.Namespace) -> None:
    """Re-runs this script under the venv's python unless it is that python."""
    venv_dir = Path(args.venv).resolve()
    python = ensure_feast(venv_dir)
    if Path(sys.prefix).resolve() != venv_dir:
        os.execv(python, [str(python), __file__, *sys.argv[1:]])


def user_ids(n: int) -> list:
    # Sparse and wide: ids past 2**32 and past 2**53 are keyed exactly.
    return [1 + i * 7919 + (i % 3) * (1 << 40) + (1 << 60 if i % 11 == 0 else 0) for i in range(n)]


def item_ids(n: int) -> list:
    return [100_000 + i for i in range(n)]


def merchant_ids(n: int) -> list:
    return [f"m-{i:05d}" + ("-éü" if i % 13 == 0 else "") for i in range(n)]


def entities(users: int) -> dict:
    return {
        "user_id": user_ids(users),
        "item_id": item_ids(users // 2),
        "merchant_id": merchant_ids(max(users // 10, 1)),
    }


def pair_rows(users: int) -> list:
    """The (user, merchant) pairs of user_merchant: `users` of them, two
    merchants for each of the first half of the users."""
    u, m = user_ids(users), merchant_ids(max(users // 10, 1))
    pairs = dict.fromkeys((u[i // 2], m[(i * 7) % len(m)]) for i in range(users))
    return [{"user_id": user, "merchant_id": merchant} for user, merchant in pairs]


def entity_rows(view: str, users: int) -> list:
    """Every entity of `view` `build` writes, as get_online_features' entity rows."""
    from definitions import JOIN_KEYS

    keys = JOIN_KEYS[view]
    if len(keys) > 1:
        return pair_rows(users)
    return [{keys[0]: k} for k in entities(users)[keys[0]]]


def key_text(row: dict) -> str:
    """The key Quiver serves an entity row by: its one value as text, or for
    several join keys the composite key's canonical text (docs/FEATURES.md,
    "Feast"): the values in the order of their join keys' names, joined by
    '|', an integer in decimal, '|' and '\\' in a string escaped by '\\'."""
    if len(row) == 1:
        return str(next(iter(row.values())))
    parts = []
    for name in sorted(row, key=lambda k: k.encode()):
        v = row[name]
        parts.append(str(v) if isinstance(v, int) else v.replace("\\", "\\\\").replace("|", "\\|"))
    return "|".join(parts)


def write_parquet(repo: Path, users: int, seed: int) -> None:
    import numpy as np
    import pandas as pd

    sys.path.insert(0, str(repo))
    from definitions import COLUMNS, JOIN_KEYS

    rng = np.random.default_rng(seed)
    now = pd.Timestamp.now(tz="UTC").floor("s")
    (repo / "data").mkdir(exist_ok=True)
    for view, columns in COLUMNS.items():
        rows = entity_rows(view, users)
        n = len(rows)
        frame = {k: [r[k] for r in rows] for k in JOIN_KEYS[view]}
        for name, dtype in columns:
            kind = str(dtype)
            if "Float32" in kind:
                values = (rng.standard_normal(n) * 10).astype(np.float32)
                col = pd.array(values, dtype="Float32")
            elif "Float64" in kind:
                values = rng.standard_normal(n) * 1e3 + 1.0 / 3.0
                col = pd.array(values, dtype="Float64")
            elif "Int64" in kind:
                values = rng.integers(-(1 << 40), 1 << 40, n)
                col = pd.array(values, dtype="Int64")
            elif "Int32" in kind:
                values = rng.integers(-(1 << 31), (1 << 31) - 1, n)
                col = pd.array(values, dtype="Int32")
            elif "Bool" in kind:
                col = pd.array(rng.random(n) < 0.5, dtype="boolean")
            else:
                raise SystemExit(f"feast_repo: no generator for {name}'s type {kind}")
            col[rng.random(n) < NULL_SHARE] = pd.NA
            frame[name] = col
        # Two rows for some entities: materialize keeps the later one.
        df = pd.DataFrame(frame)
        df["event_timestamp"] = now - pd.to_timedelta(rng.integers(60, 3600, n), unit="s")
        df["created"] = now
        older = df.sample(frac=0.1, random_state=seed).copy()
        older["event_timestamp"] = older["event_timestamp"] - pd.Timedelta(hours=2)
        for name, _ in columns:
            older[name] = older[name].iloc[::-1].to_numpy()
        pd.concat([df, older]).to_parquet(repo / "data" / f"{view}.parquet", index=False)


def build(args: argparse.Namespace) -> None:
    in_venv(args)
    repo = Path(args.repo).resolve()
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    shutil.copy(HERE / "repo" / "definitions.py", repo / "definitions.py")
    if args.redis_cluster:
        online = f"  redis_type: redis_cluster\n  connection_string: {args.redis_cluster}\n"
    else:
        online = f"  connection_string: 127.0.0.1:{args.redis_port}\n"
    (repo / "feature_store.yaml").write_text(
        f"project: {PROJECT}\n"
        "provider: local\n"
        "registry: data/registry.db\n"
        "online_store:\n"
        "  type: redis\n"
        f"{online}"
        "offline_store:\n"
        "  type: file\n"
        f"entity_key_serialization_version: {args.entity_key_serialization_version}\n"
    )
    write_parquet(repo, args.users, args.seed)
    feast = Path(sys.executable).with_name("feast")
    if not feast.exists():
        raise SystemExit(f"feast_repo: no feast command beside {sys.executable}")
    env = dict(os.environ, FEAST_USAGE="False")
    subprocess.run([feast, "apply"], cwd=repo, check=True, env=env)
    import pandas as pd

    end = (pd.Timestamp.now(tz="UTC") + pd.Timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S")
    start = (pd.Timestamp.now(tz="UTC") - pd.Timedelta(days=2)).strftime("%Y-%m-%dT%H:%M:%S")
    subprocess.run([feast, "materialize", start, end], cwd=repo, check=True, env=env)


def as_f32(value):
    """A value get_online_features returned, as the f32 Quiver serves."""
    import numpy as np

    if value is None:
        return None
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return float(np.float32(value))


def online(args: argparse.Namespace) -> None:
    in_venv(args)
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    from definitions import JOIN_KEYS
    from feast import FeatureStore

    store = FeatureStore(repo_path=str(repo))
    out = {"views": {}}
    batch = 1000
    for service in ("scoring", "pairs"):
        for projection in store.get_feature_service(service).feature_view_projections:
            view = projection.name
            names = [f.name for f in projection.features]
            refs = [f"{view}:{n}" for n in names]
            rows = {}
            every = entity_rows(view, args.users)
            for at in range(0, len(every), batch):
                chunk = every[at : at + batch]
                got = store.get_online_features(features=refs, entity_rows=chunk).to_dict()
                for i, row in enumerate(chunk):
                    rows[key_text(row)] = [as_f32(got[n][i]) for n in names]
            out["views"][view] = {"key": JOIN_KEYS[view], "features": names, "rows": rows}
    Path(args.out).write_text(json.dumps(out))


def changed_rows(columns, n: int, seed: int):
    """n rows of new values for `columns` (no nulls: every value changes)."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    frame = {}
    for name, dtype in columns:
        kind = str(dtype)
        if "Float32" in kind:
            frame[name] = pd.array((rng.standard_normal(n) * 10 + 1000).astype(np.float32), dtype="Float32")
        elif "Float64" in kind:
            frame[name] = pd.array(rng.standard_normal(n) * 1e3 + 1e6, dtype="Float64")
        elif "Int64" in kind:
            frame[name] = pd.array(rng.integers(1 << 41, 1 << 42, n), dtype="Int64")
        elif "Int32" in kind:
            frame[name] = pd.array(rng.integers(1 << 20, 1 << 30, n), dtype="Int32")
        elif "Bool" in kind:
            frame[name] = pd.array(rng.random(n) < 0.5, dtype="boolean")
        else:
            raise SystemExit(f"feast_repo: no generator for {name}'s type {kind}")
    return frame


def write_online(store, view: str, rows: list, out: str) -> None:
    """What get_online_features returns for entity `rows` of `view`, as `online` writes it."""
    from definitions import JOIN_KEYS

    projection = next(
        p
        for service in ("scoring", "pairs")
        for p in store.get_feature_service(service).feature_view_projections
        if p.name == view
    )
    names = [f.name for f in projection.features]
    got = store.get_online_features(features=[f"{view}:{n}" for n in names], entity_rows=rows).to_dict()
    served = {key_text(row): [as_f32(got[n][i]) for n in names] for i, row in enumerate(rows)}
    Path(out).write_text(
        json.dumps({"views": {view: {"key": JOIN_KEYS[view], "features": names, "rows": served}}})
    )


def update(args: argparse.Namespace) -> None:
    in_venv(args)
    import pandas as pd

    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    from definitions import COLUMNS
    from feast import FeatureStore

    view, join_key = "user_recent", "user_id"
    ids = user_ids(args.users)[: args.count]
    frame = {join_key: ids, **changed_rows(COLUMNS[view], len(ids), args.seed)}
    df = pd.DataFrame(frame)
    now = pd.Timestamp.now(tz="UTC").floor("s")
    df["event_timestamp"] = now + pd.Timedelta(minutes=2)
    df["created"] = now
    path = repo / "data" / f"{view}.parquet"
    pd.concat([pd.read_parquet(path), df]).to_parquet(path, index=False)
    feast = Path(sys.executable).with_name("feast")
    end = (now + pd.Timedelta(minutes=3)).strftime("%Y-%m-%dT%H:%M:%S")
    env = dict(os.environ, FEAST_USAGE="False")
    subprocess.run([feast, "materialize-incremental", end], cwd=repo, check=True, env=env)
    write_online(FeatureStore(repo_path=str(repo)), view, [{join_key: k} for k in ids], args.out)


def push(args: argparse.Namespace) -> None:
    in_venv(args)
    import pandas as pd

    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    from definitions import COLUMNS
    from feast import FeatureStore
    from feast.data_source import PushMode

    from definitions import JOIN_KEYS

    view = args.view
    rows = entity_rows(view, args.users)[: args.count]
    keys = {k: [r[k] for r in rows] for k in JOIN_KEYS[view]}
    df = pd.DataFrame({**keys, **changed_rows(COLUMNS[view], len(rows), args.seed)})
    now = pd.Timestamp.now(tz="UTC").floor("s")
    df["event_timestamp"] = now + pd.Timedelta(minutes=5)
    df["created"] = now
    store = FeatureStore(repo_path=str(repo))
    store.push(f"{view}_push", df, to=PushMode.ONLINE)
    write_online(store, view, rows, args.out)


# The views in the order the model reads them: request-scope first, then
# the candidates' (what `quiver import --inputs` lists, in this order).
MODEL_VIEWS = ["user_stats", "user_recent", "merchant_risk", "item_attrs"]
ITEMS_PER_REQUEST = 32


def train(args: argparse.Namespace) -> None:
    """A LightGBM model on Feast's features, as a Feast user trains one.

    Training rows come from the offline store (`get_historical_features`
    over the feature service, point in time), the label from a rule over a
    few features; the model's features are the views of MODEL_VIEWS, each in
    the service's order. Writes the model (LightGBM text) to --model, and to
    --out, for --requests requests of one user, one merchant and
    ITEMS_PER_REQUEST items (the last an item Feast does not hold), what the
    model predicts on the values `get_online_features` returns for them
    (null: NaN) and how many of their rows miss a feature."""
    in_venv(args)
    import lightgbm
    import numpy as np
    import pandas as pd

    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    from feast import FeatureStore

    store = FeatureStore(repo_path=str(repo))
    service = store.get_feature_service("scoring")
    names = {p.name: [f.name for f in p.features] for p in service.feature_view_projections}
    columns = [n for view in MODEL_VIEWS for n in names[view]]
    keys = entities(args.users)
    rng = np.random.default_rng(args.seed)
    n = 4 * args.users
    entity_df = pd.DataFrame(
        {
            "user_id": rng.choice(keys["user_id"], n),
            "item_id": rng.choice(keys["item_id"], n),
            "merchant_id": rng.choice(keys["merchant_id"], n),
            "event_timestamp": pd.Timestamp.now(tz="UTC"),
        }
    )
    frame = store.get_historical_features(entity_df=entity_df, features=service).to_df()
    x = np.stack([pd.to_numeric(frame[c], errors="coerce").astype("float32").to_numpy() for c in columns], axis=1)
    signal = np.nan_to_num(x[:, columns.index("us_f32_0")]) + np.nan_to_num(x[:, columns.index("it_f32_1")])
    y = (signal + rng.standard_normal(len(signal)) * 5 > 0).astype(int)
    params = {
        "objective": "binary",
        "num_leaves": 8,
        "min_data_in_leaf": 5,
        "learning_rate": 0.3,
        "num_threads": 1,
        "deterministic": True,
        "seed": args.seed,
        "verbose": -1,
    }
    booster = lightgbm.train(params, lightgbm.Dataset(x, y, feature_name=columns), num_boost_round=20)
    booster.save_model(args.model)

    requests = []
    items = keys["item_id"]
    for r in range(args.requests):
        user = keys["user_id"][r % len(keys["user_id"])]
        merchant = keys["merchant_id"][r % len(keys["merchant_id"])]
        asked = [items[(r * ITEMS_PER_REQUEST + i) % len(items)] for i in range(ITEMS_PER_REQUEST - 1)]
        asked.append(1)  # no such item: missing whole
        rows = {}
        for view, join_key, ids in (
            ("user_stats", "user_id", [user]),
            ("user_recent", "user_id", [user]),
            ("merchant_risk", "merchant_id", [merchant]),
            ("item_attrs", "item_id", asked),
        ):
            got = store.get_online_features(
                features=[f"{view}:{c}" for c in names[view]], entity_rows=[{join_key: k} for k in ids]
            ).to_dict()
            rows[view] = [[as_f32(got[c][i]) for c in names[view]] for i in range(len(ids))]
        request_part = rows["user_stats"][0] + rows["user_recent"][0] + rows["merchant_risk"][0]
        x = np.array(
            [[np.nan if v is None else v for v in request_part + item] for item in rows["item_attrs"]],
            dtype=np.float32,
        )
        missing = sum(any(v is None for v in row) for view_rows in rows.values() for row in view_rows)
        requests.append(
            {
                "user": user,
                "merchant": merchant,
                "items": asked,
                "scores": [float(p) for p in booster.predict(x.astype(np.float64))],
                "features_missing": missing,
            }
        )
    widths = ",".join(
        f"{view}{'@candidate' if view == 'item_attrs' else ''}:{len(names[view])}" for view in MODEL_VIEWS
    )
    Path(args.out).write_text(json.dumps({"inputs": widths, "requests": requests}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--venv", required=True)
    b.add_argument("--repo", required=True)
    store = b.add_mutually_exclusive_group(required=True)
    store.add_argument("--redis-port", type=int)
    store.add_argument("--redis-cluster", help="host:port,host:port,... of a Redis Cluster's nodes")
    b.add_argument("--users", type=int, default=10_000)
    b.add_argument("--seed", type=int, default=35)
    b.add_argument("--entity-key-serialization-version", type=int, default=3, choices=[2, 3])
    o = sub.add_parser("online")
    o.add_argument("--venv", required=True)
    o.add_argument("--repo", required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--users", type=int, default=10_000)
    for name in ("update", "push"):
        u = sub.add_parser(name)
        u.add_argument("--venv", required=True)
        u.add_argument("--repo", required=True)
        u.add_argument("--out", required=True)
        u.add_argument("--users", type=int, default=10_000)
        u.add_argument("--count", type=int, default=100)
        u.add_argument("--seed", type=int, default=36)
        if name == "push":
            u.add_argument("--view", default="user_stats", choices=["user_stats", "user_merchant"])
    t = sub.add_parser("train")
    t.add_argument("--venv", required=True)
    t.add_argument("--repo", required=True)
    t.add_argument("--model", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--users", type=int, default=10_000)
    t.add_argument("--requests", type=int, default=20)
    t.add_argument("--seed", type=int, default=37)
    v = sub.add_parser("venv")
    v.add_argument("--venv", required=True)
    args = parser.parse_args()
    if args.command == "venv":
        ensure_feast(Path(args.venv).resolve())
        return
    {"build": build, "online": online, "update": update, "push": push, "train": train}[args.command](args)


if __name__ == "__main__":
    main()
