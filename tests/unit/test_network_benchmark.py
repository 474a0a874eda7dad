"""benchmarks/network.py without clusters: the analytical minimum and the records.

The runner that starts emulated hosts is replaced by a fake returning what a
measurement would; the real run is `python -m benchmarks.run --network` (and
tests/cluster/test_multihost.py for the hosts themselves).
"""

import json

import pytest

from benchmarks import model as model_lib
from benchmarks import network, run


def _spec(hidden=(1024, 1024, 512, 256)):
    return model_lib.ModelSpec(hidden=tuple(hidden))


def test_dense_parameters_of_the_dlrm_top_mlp():
    # 429 inputs (13 dense + 26 x 16) -> 1024 -> 1024 -> 512 -> 256 -> 1, with biases.
    expected = (429 * 1024 + 1024) + (1024 * 1024 + 1024) + (1024 * 512 + 512) \
        + (512 * 256 + 256) + (256 + 1)
    assert network.dense_parameters(_spec()) == expected == 2_146_305


def test_analytical_minimum_per_setup():
    spec, b = _spec(), 256
    dense_bytes = 4 * network.dense_parameters(spec)
    embedding = 26 * (8 + 2 * 4 * 16)
    stock = network.analytical_min_bytes_per_example("stock_pss", spec, 8, b)
    assert stock == {"embedding": embedding, "dense": 2 * dense_bytes / b,
                     "total": embedding + 2 * dense_bytes / b}
    for w in (2, 4, 8):
        hybrid = network.analytical_min_bytes_per_example("hybrid_sync", spec, w, b)
        assert hybrid["dense"] == pytest.approx(2 * (w - 1) * dense_bytes / (w * b))
    # Ring all-reduce moves half of stock's dense bytes at W=2, 7/8 at W=8.
    assert network.analytical_min_bytes_per_example("hybrid_sync", spec, 2, b)["dense"] \
        == pytest.approx(stock["dense"] / 2)


def _fake_result(setup, w, eps):
    names = ["chief", "ps0", "ps1"] + [f"worker{i}" for i in range(w)]
    hybrid = setup != "stock_pss"
    steps = 8 if hybrid else 8 * w
    return {"examples_per_sec": eps, "timed_seconds": 10.0, "timed_steps": steps,
            "examples": steps * (256 * w if hybrid else 256),
            "bytes": {n: {"rx_bytes": 1000 * (i + 1), "tx_bytes": 500 * (i + 1)}
                      for i, n in enumerate(names)}}


def test_records_ratios_and_summary(monkeypatch, capsys):
    eps = {("stock_pss", 2): 100.0, ("hybrid_sync", 2): 150.0, ("hybrid_async", 2): 160.0,
           ("hybrid_sync_allgather", 2): 140.0, ("hybrid_sync_allgather", 8): 150.0,
           ("stock_pss", 8): 80.0, ("hybrid_sync", 8): 200.0, ("hybrid_async", 8): 210.0}
    monkeypatch.setattr(network, "run_one",
                        lambda setup, w, *a, **kw: _fake_result(setup, w, eps[(setup, w)]))
    args = run.parse_args(["--network", "--quick", "--network_workers", "2,8",
                           "--setups", ",".join(network.NETWORK_SETUPS)])
    lines = []
    network.mode_network(args, "/tmp", lines.append)
    records = [r for r in lines if r["kind"] == "network"]
    assert [(r["setup"], r["num_workers"]) for r in records] == [
        (s, w) for w in (2, 8) for s in network.NETWORK_SETUPS]
    by = {(r["setup"], r["num_workers"]): r for r in records}
    assert by[("hybrid_sync", 8)]["ratio_to_stock_pss"] == 2.5
    assert by[("stock_pss", 2)]["ratio_to_stock_pss"] == 1.0
    assert {r["variant"] for r in records} == {"baseline"}  # The model variant run (--variant).
    r = by[("hybrid_sync", 2)]
    # Workers are the 4th and 5th hosts: (4000+2000 + 5000+2500)/2 bytes over 8 steps.
    assert r["worker_bytes_per_step"] == round((6000 + 7500) / 2 / 8)
    assert r["total_bytes_per_example"] == round(500 * (1 + 2 + 3 + 4 + 5) / (8 * 512), 1)
    # The ring all-reduce part: each worker sends and receives 2 (W-1)/W x 4 x params.
    ring = 2 * 2 * (2 - 1) / 2 * 4 * network.dense_parameters(_spec())
    assert r["worker_allreduce_bytes_per_step"] == round(ring)
    assert r["worker_bytes_per_step_beyond_allreduce"] == round((6000 + 7500) / 2 / 8 - ring)
    assert "worker_allreduce_bytes_per_step" not in by[("stock_pss", 2)]
    # Every line says which strategy options made its figure (stacking: the default).
    assert r["strategy_options"] == {"embedding_updates": "sync", "sharding": None,
                                     "sparse_exchange": "ps", "stack_tables": True,
                                     "table_dtype": "float32", "dense_bucket_bytes": None,
                                     "dense_allreduce_dtype": None}
    assert by[("hybrid_sync_allgather", 8)]["strategy_options"]["sparse_exchange"] == "allgather"
    assert by[("stock_pss", 2)]["strategy_options"] is None
    summary = lines[-1]
    assert summary["kind"] == "network_summary"
    assert summary["hybrid_sync_over_stock_pss_at_max_w"] == 2.5
    assert summary["workers_compared"] == [2, 8]
    # Ring all-reduce bytes per worker grow as (W-1)/W: 7/8 over 1/2 from W=2 to 8.
    assert summary["allreduce_bytes_growth_bound"] == 1.75
    assert "hybrid_sync_worker_bytes_beyond_allreduce_growth" in summary
    assert summary["hybrid_sync_allgather_over_stock_pss_at_max_w"] == 1.875
    # Per setup: the worst ratio to the analytical minimum over its W.
    assert set(summary["max_ratio_to_analytical_min"]) == set(network.NETWORK_SETUPS)
    assert summary["max_ratio_to_analytical_min"]["hybrid_sync"] == max(
        by[("hybrid_sync", w)]["ratio_to_analytical_min"] for w in (2, 8))
    assert network.summarize(records, _spec()) == summary
    json.dumps(lines)  # every line is JSON


def test_half_precision_tables_side_by_side(monkeypatch):
    """--table_dtype float32,bfloat16: the plugin's setups once per dtype, bytes compared."""
    calls = []

    def fake_run_one(setup, w, args, spec_dict, log_dir, table_dtype="float32",
                     allreduce_dtype=None):
        calls.append((setup, table_dtype, spec_dict["optimizer"]))
        result = _fake_result(setup, w, 100.0)
        if table_dtype == "bfloat16":  # Fewer bytes on every host.
            result["bytes"] = {n: {k: v // 2 for k, v in b.items()}
                               for n, b in result["bytes"].items()}
        return result

    monkeypatch.setattr(network, "run_one", fake_run_one)
    args = run.parse_args(["--network", "--quick", "--network_workers", "2",
                           "--table_dtype", "float32,bfloat16", "--optimizer", "adagrad"])
    lines = []
    network.mode_network(args, "/tmp", lines.append)
    assert calls == [("stock_pss", "float32", "adagrad"), ("hybrid_sync", "float32", "adagrad"),
                     ("hybrid_sync", "bfloat16", "adagrad")]
    records = [r for r in lines if r["kind"] == "network"]
    assert [(r["setup"], r["table_dtype"]) for r in records] == [
        ("stock_pss", None), ("hybrid_sync", "float32"), ("hybrid_sync", "bfloat16")]
    half = records[2]
    assert half["strategy_options"]["table_dtype"] == "bfloat16"
    # The minimum counts 2 bytes per looked-up value and per gradient value.
    assert half["analytical_min_bytes_per_example"]["embedding"] == 26 * (8 + 2 * 2 * 16)
    assert records[1]["analytical_min_bytes_per_example"]["embedding"] == 26 * (8 + 2 * 4 * 16)
    summary = lines[-1]
    assert summary["bytes_per_example_over_float32_tables"] == {"hybrid_sync bfloat16 W=2": 0.5}
    # The float32 figures alone make the targets' ratios.
    assert summary["hybrid_sync_over_stock_pss_at_max_w"] == 1.0


def test_compressed_all_reduce_side_by_side(monkeypatch):
    """--dense_allreduce_dtype none,bfloat16: the plugin's setups once per dtype, stock once."""
    calls = []

    def fake_run_one(setup, w, args, spec_dict, log_dir, table_dtype="float32",
                     allreduce_dtype=None):
        calls.append((setup, allreduce_dtype))
        result = _fake_result(setup, w, 150.0 if allreduce_dtype else 100.0)
        if allreduce_dtype:  # Fewer bytes on every host.
            result["bytes"] = {n: {k: v // 2 for k, v in b.items()}
                               for n, b in result["bytes"].items()}
        return result

    monkeypatch.setattr(network, "run_one", fake_run_one)
    args = run.parse_args(["--network", "--quick", "--network_workers", "8", "--setups",
                           "stock_pss,hybrid_sync", "--dense_allreduce_dtype", "none,bfloat16",
                           "--dense_bucket_bytes", "262144"])
    lines = []
    network.mode_network(args, "/tmp", lines.append)
    assert calls == [("stock_pss", None), ("hybrid_sync", None), ("hybrid_sync", "bfloat16")]
    records = [r for r in lines if r["kind"] == "network"]
    packed = records[2]
    assert packed["dense_allreduce_dtype"] == "bfloat16" and packed["ratio_to_stock_pss"] == 1.5
    assert packed["strategy_options"]["dense_allreduce_dtype"] == "bfloat16"
    assert packed["strategy_options"]["dense_bucket_bytes"] == 262144
    assert records[1]["strategy_options"]["dense_allreduce_dtype"] is None
    assert records[0]["dense_allreduce_dtype"] is None
    # The ring moves 2 bytes per gradient value instead of 4.
    spec = _spec()
    assert packed["worker_allreduce_bytes_per_step"] == round(
        network.ring_allreduce_bytes_per_worker_step(spec, 8) / 2)
    assert packed["analytical_min_bytes_per_example"]["dense"] == pytest.approx(
        records[1]["analytical_min_bytes_per_example"]["dense"] / 2)
    summary = lines[-1]
    assert summary["compressed_allreduce_over_uncompressed"] == {
        "hybrid_sync bfloat16 W=8": {"examples_per_sec": 1.5, "worker_bytes_per_step": 0.5}}
    # The uncompressed figures alone make the targets' ratios.
    assert summary["hybrid_sync_over_stock_pss_at_max_w"] == 1.0
    with pytest.raises(SystemExit):  # Several values outside --network.
        run.parse_args(["--dense_allreduce_dtype", "none,bfloat16"])
    with pytest.raises(SystemExit):
        run.parse_args(["--network", "--dense_allreduce_dtype", "int8"])
    assert run.parse_args(["--dense_allreduce_dtype", "float16"]).allreduce_dtype_list == [
        "float16"]


def test_network_arguments():
    args = run.parse_args(["--network"])
    assert args.setup_list == list(network.NETWORK_SETUPS)
    assert run.parse_args(["--network", "--setups", "hybrid_sync_allgather"]).setup_list == [
        "hybrid_sync_allgather"]
    with pytest.raises(SystemExit):  # a network-only setup outside --network
        run.parse_args(["--setups", "hybrid_sync_allgather"])
    assert args.network_workers == [2, 4, 8] and args.hidden == [1024, 1024, 512, 256]
    quick = run.parse_args(["--network", "--quick"])
    assert quick.network_steps < args.network_steps
    assert quick.network_workers == [2, 8] and quick.setup_list == ["stock_pss", "hybrid_sync"]
    with pytest.raises(SystemExit):
        run.parse_args(["--network", "--network_steps", "6", "--network_spe", "4"])
