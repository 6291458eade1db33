"""Session fixtures: the demo data and the ``quiver serve`` processes.

The servers are started once per session (inline inference, and
``--inference thread`` for out-of-order answers; one with ``[[groups]]``
for feature group keys) and stopped by PID in a ``finally``, so a failing
test cannot leave one running.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import quiver_client as q
from helpers import GROUP_BIAS, GROUP_CONFIG, GROUP_ROWS, N, QUIVER_BIN, QuiverServer, build_linear_model, build_replica
from helpers import demo_request


def pytest_report_header(config):
    return [f"quiver_client: {Path(q.__file__).parent}", f"quiver binary: {QUIVER_BIN}"]


@pytest.fixture(scope="session")
def quiver_bin() -> Path:
    if not QUIVER_BIN.is_file():
        pytest.fail(f"{QUIVER_BIN} does not exist: run `cargo build --release` or set QUIVER_BIN")
    return QUIVER_BIN


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory, quiver_bin) -> Path:
    d = tmp_path_factory.mktemp("demo")
    subprocess.run([str(quiver_bin), "demo", "--data-dir", str(d)], check=True, capture_output=True, timeout=60)
    return d


def _server(demo_dir: Path, tmp_path_factory, name: str, *extra: str):
    server = QuiverServer(demo_dir, tmp_path_factory.mktemp(name) / "serve.log", *extra)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(demo_dir, tmp_path_factory):
    """``quiver serve`` with inline inference (the default)."""
    yield from _server(demo_dir, tmp_path_factory, "inline")


@pytest.fixture(scope="session")
def thread_server(demo_dir, tmp_path_factory):
    """``quiver serve --inference thread``: answers may leave out of order.

    ``stage.jobs_per_shard_max`` is raised from 256 so 1,000 pipelined
    requests all reach the inference thread: past the slots a request steps
    down (reason overload) and counts as a primary failure, which soon opens
    the circuit breaker for everyone.
    """
    config = tmp_path_factory.mktemp("thread-config") / "quiver.toml"
    config.write_text("[stage]\njobs_per_shard_max = 2048\n")
    yield from _server(demo_dir, tmp_path_factory, "thread", "--config", str(config), "--inference", "thread")


@pytest.fixture(scope="session")
def singles(server):
    """Demo request i's answer when sent alone: the reference for pipelining."""
    with q.Client(server.addr) as c:
        return [c.score(demo_request(i)) for i in range(N)]


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory) -> Path:
    """A self-signed certificate for 127.0.0.1 and localhost, its key beside it (``.key``)."""
    d = tmp_path_factory.mktemp("tls")
    crt, key = d / "server.crt", d / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "2", "-keyout", str(key), "-out", str(crt), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:FALSE"],
        check=True, capture_output=True, timeout=60,
    )
    return crt


@pytest.fixture(scope="session")
def tls_server(demo_dir, tmp_path_factory, tls_cert):
    """``quiver serve --tls-cert/--tls-key``: the scoring port speaks TLS only."""
    yield from _server(demo_dir, tmp_path_factory, "tls", "--tls-cert", str(tls_cert),
                       "--tls-key", str(tls_cert.with_suffix(".key")))


@pytest.fixture(scope="session")
def group_server(tmp_path_factory, quiver_bin):
    """``quiver serve`` with the ``[[groups]]`` of ``helpers.GROUP_CONFIG``
    (card: u64 per request, device: string keys of up to 16 bytes per
    request, ad: u64 per candidate; each must be sent) and a model scoring
    the sum of their rows plus ``GROUP_BIAS`` (``helpers.group_score``)."""
    d = tmp_path_factory.mktemp("groups")
    for name, (rows, default, key_bytes) in GROUP_ROWS.items():
        build_replica(quiver_bin, d / f"{name}.qrep", name, rows, default, key_bytes)
    build_linear_model(quiver_bin, d / "model.qm", "card:1,device:1,ad@candidate:1", [1.0, 1.0, 1.0], GROUP_BIAS)
    config = d / "quiver.toml"
    config.write_text(GROUP_CONFIG)
    yield from _server(d, tmp_path_factory, "groups-serve", "--config", str(config))
