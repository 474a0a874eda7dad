"""`python -m benchmarks.run --network`: scale-out on emulated hosts with slow links.

Why this module exists: every other benchmark runs on loopback, where the
network costs nothing and the 2 cores are the limit. The reason to keep
dense variables off the PS is the PS hosts' links: with W workers, stock
ParameterServerStrategy pulls and pushes every dense variable through P PS
links per step of every worker, while hybrid sync all-reduces them over the
workers' own links. This mode gives every task its own host
(`tf_psplugin.testing.hosts.EmulatedHosts`: network namespace, address,
token-bucket link) and measures examples/s and the exact bytes each host
sent and received, for stock PSS and hybrid sync/async with W workers.

What runs, per (setup, W): chief + W workers + P PS, one host each, every
link limited to `--link_mbit` in each direction; the benchmark model with a
DLRM-sized top MLP (`--hidden`, default 1024-1024-512-256: 2.1M dense
parameters, 8.4 MB); a fixed per-worker batch (`--per_worker_batch`). Stock
PSS runs W times as many (asynchronous, one-worker) steps so that every
setup trains the same number of examples. Bytes are read from every host's
interface counters at the end of the warm-up epoch and at the end of the
last epoch (the chief prints a line at each epoch end).

Per line (`kind: "network"`): `setup`, `num_workers`, `examples_per_sec`,
`ratio_to_stock_pss` (same W), `bytes_per_example` per role (mean over the
role's hosts, sent + received, per example trained by the whole job),
`worker_bytes_per_step` (per worker host, sent + received, per step of that
worker), `total_bytes_per_example` (sent by all hosts together), and
`analytical_min_bytes_per_example` with `ratio_to_analytical_min`: what the
setup must move at the least (see `analytical_min_bytes_per_example`).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from benchmarks import procs

# hybrid_sync_allgather: sync mode with experimental_sparse_exchange="allgather" (the
# earlier design), to show what summing the sparse gradients on the PS saves.
NETWORK_SETUPS = ("stock_pss", "hybrid_sync", "hybrid_sync_allgather", "hybrid_async")
QUICK_SETUPS = ("stock_pss", "hybrid_sync")
DLRM_TOP_MLP = (1024, 1024, 512, 256)
PORT = 2222  # every emulated host has its own port space
EXIT_GRACE_SECONDS = 120  # for the chief to exit after its last timed epoch


def dense_parameters(spec) -> int:
    """Parameters of the MLP (dense features + embeddings in, logit out)."""
    width = 13 + spec.num_categorical * spec.embedding_dim
    total = 0
    for h in list(spec.hidden) + [1]:
        total += width * h + h
        width = h
    return total


def analytical_min_bytes_per_example(setup: str, spec, num_workers: int,
                                     per_worker_batch: int,
                                     table_bytes: int = 4,
                                     gradient_bytes: int = 4) -> Dict[str, float]:
    """Bytes all hosts together must send per example, at the least.

    * Embeddings (every setup): each example's ids go to the PS (int64), the
      looked-up rows come back and their gradients go back to the PS
      (`table_bytes` per value: 4 for float32 tables, 2 for half-precision
      ones): 26 x (8 + 2 x table_bytes x dim) bytes. Repeated ids in a batch are
      counted each time (the model does not de-duplicate).
    * Dense, stock PSS: each step (one worker, one batch) pulls every dense
      variable from the PS and pushes its gradient: 2 x 4 x params / batch.
    * Dense, hybrid: a ring all-reduce of the gradients, each of the W workers
      sends 2 (W-1)/W x 4 x params per step of W x batch examples:
      2 (W-1) x 4 x params / (W x batch). Variables never move. With the
      gradients all-reduced in 16 bits (`gradient_bytes` 2,
      HybridOptions.dense_allreduce_dtype) 2 instead of 4.
    """
    dense_bytes = (4 if setup == "stock_pss" else gradient_bytes) * dense_parameters(spec)
    embedding = spec.num_categorical * (8 + 2 * table_bytes * spec.embedding_dim)
    if setup == "stock_pss":
        dense = 2 * dense_bytes / per_worker_batch
    else:
        w = num_workers
        dense = 2 * (w - 1) * dense_bytes / (w * per_worker_batch)
    return {"embedding": embedding, "dense": dense, "total": embedding + dense}


def _tf_config(cluster: Dict[str, List[str]], task_type: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def _wait_for_line(path: str, needle: str, proc: subprocess.Popen, timeout: float) -> float:
    """Waits until `needle` appears in the file at `path`; returns the monotonic time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, encoding="utf-8", errors="replace") as f:
            if needle in f.read():
                return time.monotonic()
        if proc.poll() is not None:
            raise procs.BenchmarkProcessError(
                f"chief exited {proc.returncode} before {needle!r}; log {path}:\n"
                f"{procs._tail(path)}")  # pylint: disable=protected-access
        time.sleep(0.05)
    raise procs.BenchmarkProcessError(f"no {needle!r} within {timeout:.0f} s; log {path}")


def setup_options(setup: str) -> Dict[str, str]:
    """The job fields that make a network setup what its name says."""
    return {"embedding_updates": "async" if setup == "hybrid_async" else "sync",
            "sparse_exchange": "allgather" if setup == "hybrid_sync_allgather" else "ps"}


def run_one(setup: str, num_workers: int, args, spec_dict: dict, log_dir: str,
            table_dtype: str = "float32", allreduce_dtype: Optional[str] = None) -> dict:
    """One (setup, W, table dtype, all-reduce dtype) on fresh emulated hosts; the raw measurement.

    `allreduce_dtype` is the hybrid setups' HybridOptions.dense_allreduce_dtype
    (None: the gradients' own dtype).
    """
    from tf_psplugin.testing import hosts as hosts_lib  # pylint: disable=g-import-not-at-top

    num_ps = args.num_ps
    names = (["chief"] + [f"ps{i}" for i in range(num_ps)]
             + [f"worker{i}" for i in range(num_workers)])
    b = args.per_worker_batch
    hybrid = setup != "stock_pss"
    steps = args.network_steps
    # Stock PSS steps are one worker's batch each: W times as many steps.
    epoch_steps = steps if hybrid else steps * num_workers
    job = {
        "role": "ps_chief", "setup": setup, "model": spec_dict,
        "global_batch": b * num_workers if hybrid else b,
        "num_workers": num_workers, "num_ps": num_ps,
        "steps_per_execution": args.network_spe, "steps_per_epoch": epoch_steps,
        "timed_epochs": args.network_epochs, "pool_batches": 4,
        "partition_min_bytes": 1 << 20, "announce_epochs": True, **setup_options(setup),
        "table_dtype": table_dtype,
        "dense_bucket_bytes": getattr(args, "dense_bucket_bytes", None),
        "dense_allreduce_dtype": allreduce_dtype if hybrid else None,
    }
    tag = ("" if table_dtype == "float32" else f"-{table_dtype}") + (
        f"-allreduce-{allreduce_dtype}" if allreduce_dtype and hybrid else "")
    log = os.path.join(log_dir, f"network-{setup}{tag}-w{num_workers}.log")
    env = procs.child_env()
    with hosts_lib.EmulatedHosts(names, rate_mbit=args.link_mbit) as hosts:
        cluster = {"chief": [f"{hosts.address('chief')}:{PORT}"],
                   "worker": [f"{hosts.address(f'worker{i}')}:{PORT}"
                              for i in range(num_workers)],
                   "ps": [f"{hosts.address(f'ps{i}')}:{PORT}" for i in range(num_ps)]}
        server_logs = []
        for name in names[1:]:
            task_type, index = ("ps", int(name[2:])) if name.startswith("ps") else (
                "worker", int(name[6:]))
            out = open(os.path.join(log_dir, f"network-{setup}{tag}-w{num_workers}-{name}.log"),
                       "w", encoding="utf-8")  # pylint: disable=consider-using-with
            server_logs.append(out)
            hosts.popen(name, [sys.executable, "-m", "tf_psplugin.server"],
                        env=dict(env, TF_CONFIG=_tf_config(cluster, task_type, index)),
                        stdout=out, stderr=subprocess.STDOUT)
        with open(log, "w", encoding="utf-8") as out:
            chief = hosts.popen("chief", procs.child_command(job),
                                env=dict(env, TF_CONFIG=_tf_config(cluster, "chief", 0)),
                                stdout=out, stderr=subprocess.STDOUT)
            exited = True
            try:
                t0 = _wait_for_line(log, "BENCH_EPOCH_END 0", chief, args.timeout)
                first = hosts.all_counters()
                last_epoch = args.network_epochs
                t1 = _wait_for_line(log, f"BENCH_EPOCH_END {last_epoch}", chief, args.timeout)
                last = hosts.all_counters()
                try:
                    chief.wait(timeout=EXIT_GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    # Measured once: stock PSS with 8 workers on 50 Mbit/s
                    # links printed its last epoch end and did not return
                    # from fit() within 120 s. The timed epochs are complete
                    # by then; the hosts' cleanup kills the chief.
                    exited = False
            finally:
                for f in server_logs:
                    f.close()
        if exited and chief.returncode != 0:
            raise procs.BenchmarkProcessError(
                f"chief exited {chief.returncode}; log {log}:\n{procs._tail(log)}")  # pylint: disable=protected-access
    if exited:
        with open(log, encoding="utf-8") as f:
            result = procs.parse_result(f.read())
    else:
        # The same interval as the chief's own timer, on this process's clock
        # (the lines are polled every 50 ms).
        timed_steps = epoch_steps * args.network_epochs
        examples_per_step = b * num_workers if hybrid else b
        result = {"timed_steps": timed_steps, "timed_seconds": t1 - t0,
                  "examples_per_sec": timed_steps * examples_per_step / (t1 - t0),
                  "chief_exit": f"did not exit within {EXIT_GRACE_SECONDS} s of its last "
                                "epoch; killed (timing from its epoch-end lines)"}
    result["bytes"] = {n: {k: last[n][k] - first[n][k] for k in ("rx_bytes", "tx_bytes")}
                       for n in names}
    result["examples"] = result["timed_steps"] * (b * num_workers if hybrid else b)
    return result


def network_record(setup: str, num_workers: int, result: dict, args, spec,
                   table_dtype: str = "float32",
                   allreduce_dtype: Optional[str] = None) -> dict:
    examples = result["examples"]
    per_role: Dict[str, List[int]] = {"chief": [], "ps": [], "worker": []}
    for name, moved in result["bytes"].items():
        role = "worker" if name.startswith("worker") else ("ps" if name.startswith("ps")
                                                          else "chief")
        per_role[role].append(moved["rx_bytes"] + moved["tx_bytes"])
    worker_steps = (result["timed_steps"] if setup != "stock_pss"
                    else result["timed_steps"] / num_workers)
    total_tx = sum(m["tx_bytes"] for m in result["bytes"].values())
    minimum = analytical_min_bytes_per_example(setup, spec, num_workers, args.per_worker_batch,
                                               table_bytes=4 if table_dtype == "float32" else 2,
                                               gradient_bytes=2 if allreduce_dtype else 4)
    worker_bytes_per_step = sum(per_role["worker"]) / len(per_role["worker"]) / worker_steps
    record = {
        "kind": "network", "setup": setup, "variant": spec.variant,
        "num_workers": num_workers, "num_ps": args.num_ps,
        "table_dtype": table_dtype if setup != "stock_pss" else None,
        "dense_allreduce_dtype": allreduce_dtype if setup != "stock_pss" else None,
        "link_mbit": args.link_mbit, "per_worker_batch": args.per_worker_batch,
        "examples_per_sec": round(result["examples_per_sec"], 1),
        "timed_seconds": round(result["timed_seconds"], 2), "examples": examples,
        "bytes_per_example": {role: round(sum(v) / len(v) / examples, 1)
                              for role, v in per_role.items() if v},
        "worker_bytes_per_step": round(worker_bytes_per_step),
        "total_bytes_per_example": round(total_tx / examples, 1),
        "analytical_min_bytes_per_example": {k: round(v, 1) for k, v in minimum.items()},
        "ratio_to_analytical_min": round(total_tx / examples / minimum["total"], 3),
        "dense_parameters": dense_parameters(spec),
        # The plugin's strategy arguments (None: stock PSS).
        "strategy_options": (procs.strategy_options(dict(
            setup_options(setup), table_dtype=table_dtype,
            dense_bucket_bytes=getattr(args, "dense_bucket_bytes", None),
            dense_allreduce_dtype=allreduce_dtype))
                             if setup != "stock_pss" else None),
    }
    if setup != "stock_pss":
        # What the strategy chose for dense_bucket_bytes None (the default):
        # every task here is a host of its own. None if the chief did not say.
        record["dense_bucket_bytes_used"] = result.get("dense_bucket_bytes_used")
    if "chief_exit" in result:
        record["chief_exit"] = result["chief_exit"]
    if setup != "stock_pss":
        # What a worker moves besides the dense ring all-reduce (which sends
        # and receives 2 (W-1)/W x 4 x params each per step, whatever the
        # design; half of it in 16 bits): embedding ids, rows, gradient
        # exchange, control.
        ring = ring_allreduce_bytes_per_worker_step(spec, num_workers,
                                                    gradient_bytes=2 if allreduce_dtype else 4)
        record["worker_allreduce_bytes_per_step"] = round(ring)
        record["worker_bytes_per_step_beyond_allreduce"] = round(worker_bytes_per_step - ring)
    return record


def ring_allreduce_bytes_per_worker_step(spec, num_workers: int,
                                         gradient_bytes: int = 4) -> float:
    """Bytes one worker sends plus receives per step in a ring all-reduce of the dense gradients.

    `gradient_bytes` per value: 4 (float32), 2 in 16 bits
    (HybridOptions.dense_allreduce_dtype).
    """
    w = num_workers
    return 2 * 2 * (w - 1) / w * gradient_bytes * dense_parameters(spec)


def mode_network(args, log_dir: str, emit) -> List[dict]:
    """Every setup at every W, one after another; one JSON line each, then the ratios."""
    from benchmarks import model as model_lib  # pylint: disable=g-import-not-at-top

    spec_dict = {"vocab_size": args.vocab_size, "embedding_dim": args.embedding_dim,
                 "variant": args.variant, "hidden": list(args.hidden),
                 "optimizer": getattr(args, "optimizer", "legacy_adagrad")}
    spec = model_lib.ModelSpec.from_dict(spec_dict)
    # Half-precision tables (--table_dtype) for the plugin's setups only.
    # ... and with each --dense_allreduce_dtype ("none": the gradients' own).
    runs = [(setup, dtype, wire) for dtype in getattr(args, "table_dtype_list", ["float32"])
            for wire in getattr(args, "allreduce_dtype_list", [None])
            for setup in args.setup_list
            if (dtype == "float32" and wire is None) or setup != "stock_pss"]
    records = []
    for w in args.network_workers:
        by_setup = {}
        for setup, dtype, wire in runs:
            sys.stderr.write(f"[network] {setup} {dtype} tables, all-reduce {wire} W={w} ...\n")
            try:
                record = network_record(
                    setup, w, run_one(setup, w, args, spec_dict, log_dir, table_dtype=dtype,
                                      allreduce_dtype=wire),
                    args, spec, table_dtype=dtype, allreduce_dtype=wire)
            except procs.BenchmarkProcessError as e:
                record = {"kind": "network", "setup": setup, "num_workers": w,
                          "table_dtype": dtype, "dense_allreduce_dtype": wire,
                          "error": str(e)[-1500:], "examples_per_sec": None}
            by_setup[(setup, dtype, wire)] = record
        stock = by_setup.get(("stock_pss", "float32", None), {}).get("examples_per_sec")
        for record in by_setup.values():
            eps = record.get("examples_per_sec")
            record["ratio_to_stock_pss"] = round(eps / stock, 3) if eps and stock else None
            emit(record)
            records.append(record)
    summary = summarize(records, spec)
    emit(summary)
    if args.chart:
        write_chart(records, args.chart)
    return records


def summarize(records: Sequence[dict], spec) -> dict:
    """The `network_summary` line: the targets and what the records reach.

    Works on any set of records (also several runs' lines put together):
    growth is from the smallest to the largest W measured per setup.
    """
    summary = {"kind": "network_summary", "targets": {
        "hybrid_sync_over_stock_pss_at_max_w": 2.0, "worker_bytes_per_step_growth": 1.3,
        "bytes_over_analytical_min": 1.3}}
    for name in ("hybrid_sync", "hybrid_sync_allgather"):
        sync = {r["num_workers"]: r for r in records
                if r["setup"] == name and r.get("examples_per_sec")
                and r.get("table_dtype") in (None, "float32")
                and not r.get("dense_allreduce_dtype")}
        if not sync:
            continue
        lo, hi = min(sync), max(sync)
        summary[f"{name}_over_stock_pss_at_max_w"] = sync[hi].get("ratio_to_stock_pss")
        summary[f"{name}_worker_bytes_per_step_growth"] = round(
            sync[hi]["worker_bytes_per_step"] / sync[lo]["worker_bytes_per_step"], 3)
        summary[f"{name}_worker_bytes_beyond_allreduce_growth"] = round(
            sync[hi]["worker_bytes_per_step_beyond_allreduce"]
            / sync[lo]["worker_bytes_per_step_beyond_allreduce"], 3)
        summary["workers_compared"] = [lo, hi]
        # Ring all-reduce bytes per worker grow as (W-1)/W whatever the design.
        summary["allreduce_bytes_growth_bound"] = round(
            ring_allreduce_bytes_per_worker_step(spec, hi)
            / ring_allreduce_bytes_per_worker_step(spec, lo), 3)
    ratios: Dict[str, List[float]] = {}
    for r in records:
        if r.get("ratio_to_analytical_min") is not None:
            ratios.setdefault(r["setup"], []).append(r["ratio_to_analytical_min"])
    summary["max_ratio_to_analytical_min"] = {s: max(v) for s, v in ratios.items()}
    # Half-precision tables (--table_dtype): bytes per example against the
    # same setup and W with float32 tables.
    float32 = {(r["setup"], r["num_workers"]): r for r in records
               if r.get("table_dtype") == "float32" and r.get("total_bytes_per_example")
               and not r.get("dense_allreduce_dtype")}
    for r in records:
        base = float32.get((r["setup"], r.get("num_workers")))
        if r.get("table_dtype") not in (None, "float32") and base and \
                r.get("total_bytes_per_example"):
            key = f"{r['setup']} {r['table_dtype']} W={r['num_workers']}"
            summary.setdefault("bytes_per_example_over_float32_tables", {})[key] = round(
                r["total_bytes_per_example"] / base["total_bytes_per_example"], 3)
        # Gradients all-reduced in 16 bits (--dense_allreduce_dtype): against
        # the same setup, W and tables all-reduced in their own dtype.
        if r.get("dense_allreduce_dtype") and base and r.get("examples_per_sec") \
                and base.get("examples_per_sec") and r.get("table_dtype") == "float32":
            key = f"{r['setup']} {r['dense_allreduce_dtype']} W={r['num_workers']}"
            summary.setdefault("compressed_allreduce_over_uncompressed", {})[key] = {
                "examples_per_sec": round(r["examples_per_sec"] / base["examples_per_sec"], 3),
                "worker_bytes_per_step": round(
                    r["worker_bytes_per_step"] / base["worker_bytes_per_step"], 3)}
    return summary


def write_chart(records: Sequence[dict], path: str) -> Optional[str]:
    """examples/s and bytes per example vs workers, one line per setup (PNG)."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        sys.stderr.write("[network] no chart: pip install -e .[bench] for matplotlib\n")
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = dict(zip(NETWORK_SETUPS, ("tab:blue", "tab:green", "tab:purple", "tab:orange")))
    for setup in NETWORK_SETUPS:
        rows = sorted((r["num_workers"], r) for r in records
                      if r["setup"] == setup and r.get("examples_per_sec"))
        if not rows:
            continue
        ws, c = [w for w, _ in rows], colors[setup]
        ax1.plot(ws, [r["examples_per_sec"] for _, r in rows], marker="o", color=c, label=setup)
        ax2.plot(ws, [r["total_bytes_per_example"] / 1024 for _, r in rows], marker="o",
                 color=c, label=f"{setup} measured")
        ax2.plot(ws, [r["analytical_min_bytes_per_example"]["total"] / 1024 for _, r in rows],
                 linestyle=":", color=c, label=f"{setup} minimum")
        ax3.plot(ws, [r["worker_bytes_per_step"] / 2**20 for _, r in rows], marker="o",
                 color=c, label=f"{setup} total")
        if setup != "stock_pss":
            ax3.plot(ws, [r["worker_bytes_per_step_beyond_allreduce"] / 2**20 for _, r in rows],
                     marker="s", linestyle="--", color=c, label=f"{setup} beyond all-reduce")
    ax1.set_ylabel("examples/s")
    ax1.set_title("throughput")
    ax2.set_ylabel("KiB sent per example (all hosts)")
    ax2.set_title("bytes per example vs the analytical minimum")
    ax3.set_ylabel("MiB per worker step (sent + received)")
    ax3.set_title("one worker's bytes per step")
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("workers (one host each)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_log_dir() -> str:
    return tempfile.mkdtemp(prefix="tf_psplugin_network_")
