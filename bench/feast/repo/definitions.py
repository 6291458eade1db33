"""The Feast repository Quiver's Feast tests and benchmark serve (issue 35).

Three entity types (two int64 join keys, one string), five feature views of
mixed types (100 features: Float32, Float64, Int64, Int32, Bool, some null),
one view with a ttl, one on two entities (user x merchant: a composite key),
the feature service `scoring` that names the four single-entity views and
the service `pairs` that names the composite one.
bench/feast/feast_repo.py copies this file into a fresh repository beside a
feature_store.yaml and the parquet files it writes, then runs `feast apply`
and `feast materialize`. The column lists are shared with that script
(`COLUMNS`), so the parquet files and the views cannot disagree.
"""

from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, PushSource, ValueType
from feast.types import Bool, Float32, Float64, Int32, Int64

# (view, entity join key, [(feature, type)]) in the order the views list them.
COLUMNS = {
    "user_stats": [(f"us_f32_{i}", Float32) for i in range(10)]
    + [(f"us_f64_{i}", Float64) for i in range(8)]
    + [(f"us_i64_{i}", Int64) for i in range(6)]
    + [(f"us_i32_{i}", Int32) for i in range(3)]
    + [(f"us_bool_{i}", Bool) for i in range(3)],
    "user_recent": [(f"ur_f32_{i}", Float32) for i in range(12)]
    + [(f"ur_i64_{i}", Int64) for i in range(6)]
    + [(f"ur_bool_{i}", Bool) for i in range(2)],
    "item_attrs": [(f"it_f64_{i}", Float64) for i in range(10)]
    + [(f"it_f32_{i}", Float32) for i in range(8)]
    + [(f"it_i32_{i}", Int32) for i in range(4)]
    + [(f"it_bool_{i}", Bool) for i in range(3)],
    "merchant_risk": [(f"mr_f32_{i}", Float32) for i in range(8)]
    + [(f"mr_i64_{i}", Int64) for i in range(5)]
    + [(f"mr_f64_{i}", Float64) for i in range(4)],
    "user_merchant": [(f"um_f32_{i}", Float32) for i in range(4)]
    + [(f"um_i64_{i}", Int64) for i in range(2)]
    + [("um_bool_0", Bool), ("um_f64_0", Float64)],
}

ENTITY_OF = {
    "user_stats": "user_id",
    "user_recent": "user_id",
    "item_attrs": "item_id",
    "merchant_risk": "merchant_id",
}

# Every view's join keys: user_merchant is keyed by a user and a merchant.
JOIN_KEYS = {**{view: [key] for view, key in ENTITY_OF.items()}, "user_merchant": ["user_id", "merchant_id"]}

user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64)
item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.INT64)
merchant = Entity(name="merchant", join_keys=["merchant_id"], value_type=ValueType.STRING)
ENTITIES = {"user_id": user, "item_id": item, "merchant_id": merchant}


def _source(view: str) -> FileSource:
    return FileSource(
        name=f"{view}_source",
        path=f"data/{view}.parquet",
        timestamp_field="event_timestamp",
        created_timestamp_column="created",
    )


def _view(view: str, ttl: timedelta, source=None) -> FeatureView:
    return FeatureView(
        name=view,
        entities=[ENTITIES[k] for k in JOIN_KEYS[view]],
        ttl=ttl,
        schema=[Field(name=name, dtype=dtype) for name, dtype in COLUMNS[view]],
        online=True,
        source=source or _source(view),
    )


# user_stats is also written by pushes (`store.push("user_stats_push", df)`),
# materialized from the same file.
user_stats_push = PushSource(name="user_stats_push", batch_source=_source("user_stats"))

# A ttl of zero is "no ttl" to Feast; user_recent's rows expire after a day.
user_stats = _view("user_stats", timedelta(seconds=0), user_stats_push)
user_recent = _view("user_recent", timedelta(days=1))
item_attrs = _view("item_attrs", timedelta(seconds=0))
merchant_risk = _view("merchant_risk", timedelta(seconds=0))

# The service lists item_attrs' features in an order of its own (the Int32
# ones first), so that a server taking the view's order would be caught.
_item_order = [n for n, _ in COLUMNS["item_attrs"] if "_i32_" in n] + [
    n for n, _ in COLUMNS["item_attrs"] if "_i32_" not in n
]
scoring = FeatureService(
    name="scoring",
    features=[user_stats, user_recent, item_attrs[_item_order], merchant_risk],
)

# Features of a (user, merchant) pair, also written by pushes.
user_merchant_push = PushSource(name="user_merchant_push", batch_source=_source("user_merchant"))
user_merchant = _view("user_merchant", timedelta(seconds=0), user_merchant_push)
pairs = FeatureService(name="pairs", features=[user_merchant])
