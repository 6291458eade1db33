#!/usr/bin/env python3
"""Drives Quiver's Open Inference Protocol (KServe v2) listeners with the
real `tritonclient` (gRPC and HTTP), as a Triton user would, and checks what
comes back against scores the FlatBuffers client got for the same requests.

Run by tests/oip.rs, which starts `quiver serve` with both listeners and
writes the cases file:

    {"model": "auction-32", "version": "1",
     "cases": [{"user_id": 7, "item_ids": [..], "context": [..],
                "score_bits": [..] (each score's f32 bits)}],
     "raw_cases": [{"rows": [[..], ..] (the model's input rows),
                    "score_bits": [..]}]}

Checks, for each transport: health (live, ready, model ready), server and
model metadata, Triton's model config (which perf_analyzer reads), every case scored exactly (bit for bit) with raw/binary and
with JSON/contents tensors, raw rows (one `rows` input, FP32 [N, width])
scored as the FlatBuffers client's raw rows, the response parameters, and each bad input
answered with the protocol's error, the server serving on afterwards.

Exit status: 0 when every check passed, 1 when one failed, 77 when
tritonclient is not installed (tests/oip.rs skips, or fails under
QUIVER_REQUIRE_TRITONCLIENT=1). Prints one line per check and a closing
"N passed, N failed".
"""

import argparse
import json
import sys

try:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"tritonclient is not installed: {e}")
    sys.exit(77)

passed = 0
failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   {name}")
    else:
        failed += 1
        print(f"FAIL {name}: {detail}")


def bits(a):
    return [int(x) for x in np.asarray(a, dtype=np.float32).view(np.uint32)]


def inputs_for(module, case, binary, with_context=True):
    """The case's tensors; `binary`: raw bytes (gRPC always sends raw)."""
    tensors = [
        ("user_id", np.array([case["user_id"]], dtype=np.int64)),
        ("item_ids", np.array(case["item_ids"], dtype=np.int64)),
    ]
    if with_context and case.get("context"):
        tensors.append(("context", np.array(case["context"], dtype=np.float32)))
    out = []
    for name, arr in tensors:
        dtype = "INT64" if arr.dtype == np.int64 else "FP32"
        t = module.InferInput(name, list(arr.shape), dtype)
        if module is httpclient:
            t.set_data_from_numpy(arr, binary_data=binary)
        else:
            t.set_data_from_numpy(arr)
        out.append(t)
    return out


def raw_rows_checks(transport, module, c, spec, binaries):
    """Each raw-rows case through `c`; a wrong width and keys beside rows refused."""
    model = spec["model"]
    bad = "StatusCode.INVALID_ARGUMENT" if module is grpcclient else "400"

    def rows_input(arr, binary):
        t = module.InferInput("rows", list(arr.shape), "FP32")
        if module is httpclient:
            t.set_data_from_numpy(arr, binary_data=binary)
        else:
            t.set_data_from_numpy(arr)
        return t

    for i, case in enumerate(spec["raw_cases"]):
        arr = np.array(case["rows"], dtype=np.float32)
        for binary in binaries:
            r = c.infer(model, [rows_input(arr, binary)], parameters={"budget_us": 1_000_000})
            how = "binary" if binary else "JSON"
            check(f"{transport} {how} raw rows case {i} ({arr.shape[0]} rows): scores equal the FlatBuffers client's",
                  bits(r.as_numpy("scores")) == case["score_bits"], f"{r.as_numpy('scores')}")
    arr = np.array(spec["raw_cases"][0]["rows"], dtype=np.float32)
    narrow = arr[:, :-1].copy()
    expect_error(f"{transport} raw rows of the wrong width", lambda: c.infer(model, [rows_input(narrow, True)]), bad,
                 "shape")
    user = module.InferInput("user_id", [1], "INT64")
    user.set_data_from_numpy(np.array([7], dtype=np.int64))
    expect_error(f"{transport} raw rows beside a key", lambda: c.infer(model, [rows_input(arr, True), user]), bad,
                 "whole input")


def expect_error(name, call, want_status, want_text):
    try:
        call()
    except InferenceServerException as e:
        status = str(e.status())
        msg = e.message() or ""
        check(
            name,
            want_status in status and want_text in msg,
            f"status {status!r}, message {msg!r}; wanted {want_status!r} with {want_text!r}",
        )
        return
    check(name, False, "no error")


def config_checks(transport, config, metadata, model, version):
    """Triton's ModelConfig (what perf_analyzer reads) against the metadata:
    the same inputs and output in Triton's types, no batch dimension."""
    types = {"INT64": "TYPE_INT64", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}
    want = [(t["name"], types[t["datatype"]], [int(d) for d in t["shape"]]) for t in metadata["inputs"]]
    got = [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config.get("input", [])]
    check(f"{transport} ModelConfig inputs are the metadata's", got == want, config)
    outs = [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config.get("output", [])]
    check(f"{transport} ModelConfig output", outs == [("scores", "TYPE_FP32", [-1])], config)
    check(
        f"{transport} ModelConfig name, no batching",
        config.get("name") == model and int(config.get("max_batch_size", 0)) == 0
        and not any(k in config for k in ("dynamic_batching", "sequence_batching", "ensemble_scheduling")),
        config,
    )
    versions = [str(v) for v in config.get("version_policy", {}).get("specific", {}).get("versions", [])]
    check(f"{transport} ModelConfig version", versions == [version], config)


def grpc_checks(url, spec):
    model, version = spec["model"], spec["version"]
    c = grpcclient.InferenceServerClient(url=url)
    check("grpc ServerLive", c.is_server_live())
    check("grpc ServerReady", c.is_server_ready())
    check("grpc ModelReady", c.is_model_ready(model))
    check("grpc ModelReady at the served version", c.is_model_ready(model, version))
    check("grpc ModelReady of an unknown model is false", not c.is_model_ready("no-such-model"))
    meta = c.get_server_metadata(as_json=True)
    check("grpc ServerMetadata", meta.get("name") == "quiver" and "binary_tensor_data" in meta.get("extensions", []), meta)
    mm = c.get_model_metadata(model, as_json=True)
    names = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in mm.get("inputs", [])}
    check(
        "grpc ModelMetadata inputs",
        names.get("user_id") == ("INT64", [1]) and names.get("item_ids") == ("INT64", [-1])
        and names.get("context", ("", []))[0] == "FP32",
        mm,
    )
    outs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in mm.get("outputs", [])}
    check("grpc ModelMetadata outputs", outs == {"scores": ("FP32", [-1])}, mm)
    check("grpc ModelMetadata versions", mm.get("versions") == [version], mm)
    config_checks("grpc", c.get_model_config(model, as_json=True)["config"], mm, model, version)
    expect_error("grpc ModelConfig of an unknown model", lambda: c.get_model_config("no-such-model"), "NOT_FOUND", "no-such-model")
    expect_error("grpc ModelConfig of an unserved version", lambda: c.get_model_config(model, "99"), "NOT_FOUND", "99")

    for i, case in enumerate(spec["cases"]):
        r = c.infer(
            model,
            inputs_for(grpcclient, case, True),
            outputs=[grpcclient.InferRequestedOutput("scores")],
            request_id=f"g{i}",
            parameters={"budget_us": 1_000_000},
        )
        got = r.as_numpy("scores")
        check(f"grpc case {i}: scores equal the FlatBuffers client's", bits(got) == case["score_bits"], f"{got}")
        params = r.get_response(as_json=True).get("parameters", {})
        tier = params.get("tier", {}).get("string_param")
        check(f"grpc case {i}: tier parameter", tier == "primary", params)
        check(f"grpc case {i}: id echoed", r.get_response().id == f"g{i}")
    # Scores with no outputs named, priority and timeout as tritonclient sends them.
    case = spec["cases"][0]
    r = c.infer(model, inputs_for(grpcclient, case, True), priority=3, timeout=500_000)
    check("grpc priority= and timeout= are taken", bits(r.as_numpy("scores")) == case["score_bits"])
    params = r.get_response(as_json=True)["parameters"]
    for key in ["reason", "model_version", "features_missing", "features_stale", "server_us"]:
        check(f"grpc response parameter {key}", key in params, params)

    def infer_with(tensors, outputs=None, model_name=model, **kw):
        ins = []
        for name, dtype, arr in tensors:
            t = grpcclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            ins.append(t)
        return lambda: c.infer(model_name, ins, outputs=outputs, **kw)

    user = ("user_id", "INT64", np.array([case["user_id"]], dtype=np.int64))
    items = ("item_ids", "INT64", np.array(case["item_ids"], dtype=np.int64))
    bad = "StatusCode.INVALID_ARGUMENT"
    expect_error("grpc wrong datatype", infer_with([user, ("item_ids", "FP32", np.ones(3, np.float32))]), bad, "datatype")
    expect_error("grpc wrong shape", infer_with([("user_id", "INT64", np.array([1, 2], np.int64)), items]), bad, "shape")
    expect_error("grpc unknown input", infer_with([user, items, ("colour", "INT64", np.array([1], np.int64))]), bad,
                 "unexpected inference input 'colour'")
    expect_error("grpc missing input", infer_with([user]), bad, "item_ids")
    expect_error("grpc more candidates than limits.candidates_max",
                 infer_with([user, ("item_ids", "INT64", np.arange(70_000, dtype=np.int64))]), bad, "shape")
    expect_error("grpc negative id", infer_with([("user_id", "INT64", np.array([-5], np.int64)), items]), bad,
                 "negative")
    expect_error("grpc unknown output", infer_with([user, items], outputs=[grpcclient.InferRequestedOutput("probs")]),
                 bad, "unexpected inference output")
    expect_error("grpc unknown model", infer_with([user, items], model_name="no-such-model"), "StatusCode.NOT_FOUND",
                 "unknown model")
    expect_error("grpc bad parameter", infer_with([user, items], parameters={"client_id": "seven"}), bad, "client_id")
    expect_error("grpc message over the size limit",
                 infer_with([user, ("item_ids", "INT64", np.arange(1_000_000, dtype=np.int64))]),
                 "StatusCode.OUT_OF_RANGE", "too large")
    raw_rows_checks("grpc", grpcclient, c, spec, [True])
    r = c.infer(model, inputs_for(grpcclient, case, True))
    check("grpc serves on after the bad inputs", bits(r.as_numpy("scores")) == case["score_bits"])
    c.close()


def http_checks(url, spec):
    model, version = spec["model"], spec["version"]
    c = httpclient.InferenceServerClient(url=url)
    check("http live", c.is_server_live())
    check("http ready", c.is_server_ready())
    check("http model ready", c.is_model_ready(model))
    check("http model ready at the served version", c.is_model_ready(model, version))
    check("http model ready of an unknown model is false", not c.is_model_ready("no-such-model"))
    meta = c.get_server_metadata()
    check("http server metadata", meta.get("name") == "quiver", meta)
    mm = c.get_model_metadata(model)
    names = {t["name"]: (t["datatype"], t["shape"]) for t in mm.get("inputs", [])}
    check("http model metadata", names.get("user_id") == ("INT64", [1]) and names.get("item_ids") == ("INT64", [-1]), mm)
    check("http model metadata versioned", c.get_model_metadata(model, version)["name"] == model)
    config_checks("http", c.get_model_config(model, version), mm, model, version)
    expect_error("http model config of an unknown model", lambda: c.get_model_config("no-such-model"), "404", "no-such-model")

    for i, case in enumerate(spec["cases"]):
        for binary in (True, False):
            r = c.infer(
                model,
                inputs_for(httpclient, case, binary),
                outputs=[httpclient.InferRequestedOutput("scores", binary_data=binary)],
                request_id=f"h{i}",
                parameters={"budget_us": 1_000_000},
            )
            got = r.as_numpy("scores")
            how = "binary" if binary else "JSON"
            check(f"http {how} case {i}: scores equal the FlatBuffers client's", bits(got) == case["score_bits"],
                  f"{got}")
            params = r.get_response().get("parameters", {})
            check(f"http {how} case {i}: parameters", params.get("tier") == "primary" and "features_missing" in params,
                  params)
    case = spec["cases"][0]
    r = c.infer(model, inputs_for(httpclient, case, True), priority=2, timeout=500_000)
    check("http no outputs named, priority= and timeout=", bits(r.as_numpy("scores")) == case["score_bits"])

    def infer_with(tensors, outputs=None, model_name=model, binary=True, **kw):
        ins = []
        for name, dtype, arr in tensors:
            t = httpclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr, binary_data=binary)
            ins.append(t)
        return lambda: c.infer(model_name, ins, outputs=outputs, **kw)

    user = ("user_id", "INT64", np.array([case["user_id"]], dtype=np.int64))
    items = ("item_ids", "INT64", np.array(case["item_ids"], dtype=np.int64))
    expect_error("http wrong datatype", infer_with([user, ("item_ids", "FP32", np.ones(3, np.float32))]), "400",
                 "datatype")
    expect_error("http wrong shape", infer_with([("user_id", "INT64", np.array([1, 2], np.int64)), items]), "400",
                 "shape")
    expect_error("http unknown input", infer_with([user, items, ("colour", "INT64", np.array([1], np.int64))]), "400",
                 "unexpected inference input 'colour'")
    expect_error("http missing input (JSON)", infer_with([user], binary=False), "400", "item_ids")
    expect_error("http more candidates than limits.candidates_max",
                 infer_with([user, ("item_ids", "INT64", np.arange(70_000, dtype=np.int64))]), "400", "shape")
    expect_error("http unknown model", infer_with([user, items], model_name="no-such-model"), "404", "unknown model")
    expect_error("http body over the size limit",
                 infer_with([user, ("item_ids", "INT64", np.arange(1_000_000, dtype=np.int64))]), "413", "")
    raw_rows_checks("http", httpclient, c, spec, [True, False])
    r = c.infer(model, inputs_for(httpclient, case, False))
    check("http serves on after the bad inputs", bits(r.as_numpy("scores")) == case["score_bits"])
    c.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grpc", required=True, help="host:port of [oip] grpc_listen")
    ap.add_argument("--http", required=True, help="host:port of [oip] http_listen")
    ap.add_argument("--cases", required=True, help="the cases file tests/oip.rs writes")
    args = ap.parse_args()
    with open(args.cases) as f:
        spec = json.load(f)
    for what, run in [("grpc", lambda: grpc_checks(args.grpc, spec)), ("http", lambda: http_checks(args.http, spec))]:
        try:
            run()
        except Exception as e:  # a check that raised is a failed check, not a crash
            check(f"{what} checks ran to the end", False, repr(e))
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
