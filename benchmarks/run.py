"""`python -m benchmarks.run`: side-by-side throughput, memory, balance, scaling.

Why this module exists: tf_psplugin's claim is that hybrid placement (tables
sharded on PS, dense variables all-reduced) beats stock
ParameterServerStrategy on CTR models and comes close to the
no-communication limit. This runs, in one invocation and one after another
on the same box, the same model under every setup and prints one JSON line
per setup (stdout) and a table (stderr). See benchmarks/README.md.

Modes (default: throughput):

* throughput: single-process Keras, stock PSS (async, tables partitioned over
  the PS), MultiWorkerMirroredStrategy (everything replicated), tf_psplugin
  hybrid with "sync" and "async" embedding updates;
* ``--memory``: hybrid sync with one table of 1M/10M/50M rows, peak RSS per role;
* ``--balance``: lookups per PS shard, contiguous vs interleaved (no cluster);
* ``--scaling``: hybrid sync vs stock PSS with 1, 2 and 4 workers.
* ``--dynamic``: a `layers.DynamicEmbedding` against a static hashed table of
  the same capacity, both under hybrid sync (`benchmarks/dynamic.py`).
* ``--mixed_precision`` / ``--table_dtype`` (comma-separated lists): every
  setup (``--memory``, ``--network``: every size or W) runs under each Keras
  policy and with the tables stored in each dtype (hybrid setups only),
  side by side; every line says which (``policy``, ``table_dtype``,
  ``strategy_options``).
* ``--dense_allreduce_dtype`` (a comma-separated list with ``--network``):
  the hybrid setups' dense gradients all-reduced in 16 bits
  (``HybridOptions.dense_allreduce_dtype``), each value side by side.
* ``--network``: stock PSS, hybrid sync (sparse gradients summed on the PS,
  and all-gathered for comparison) and hybrid async with 2, 4 and 8 workers,
  every task on its own emulated host with a rate-limited link (needs root;
  see `benchmarks/network.py`); ``--quick``: stock PSS and hybrid sync at 2
  and 8 workers.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from benchmarks import dynamic, network, procs, report

# hybrid_sync: the strategy's defaults (stacked tables, stack_tables=True);
# hybrid_sync_unstacked: the same with stack_tables=False (every table its
# own variable).
THROUGHPUT_SETUPS = ("single", "stock_pss", "mwms", "hybrid_sync", "hybrid_sync_unstacked",
                     "hybrid_async")
# Setups that run on a PS cluster with the plugin's strategy.
HYBRID_SETUPS = ("hybrid_sync", "hybrid_sync_unstacked", "hybrid_async")
SCHEMA_KEYS = ("setup", "examples_per_sec", "ratio_to_single", "ratio_to_stock_pss",
               "peak_rss_mb", "steps", "global_batch", "tf_version", "strategy_options")
DEFAULT_MEMORY_ROWS = (1_000_000, 10_000_000, 50_000_000)
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
TABLE_DTYPES = ("float32", "bfloat16", "float16")
# --dense_allreduce_dtype's values ("none": HybridOptions.dense_allreduce_dtype=None).
ALLREDUCE_DTYPES = ("none", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# --optimizer -> how the lines name it (benchmarks/model.py builds it).
OPTIMIZER_NAMES = {"legacy_adagrad": "legacy.Adagrad", "adagrad": "Adagrad", "sgd": "SGD",
                   "sgd_noslot": "SGD(no momentum slot)"}
LEARNING_RATE = 0.05  # benchmarks/model.py's ModelSpec.learning_rate
TARGETS = {"hybrid_sync_over_stock_pss": 2.0, "hybrid_sync_over_single": 0.8,
           "memory_worker_spread": 0.10, "memory_ps_over_share": 1.3, "balance_max_over_mean": 1.1}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="tf_psplugin benchmarks: JSON lines on stdout, tables on stderr.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--memory", action="store_true", help="peak RSS vs table size")
    mode.add_argument("--balance", action="store_true", help="lookups per PS shard (no cluster)")
    mode.add_argument("--scaling", action="store_true", help="1/2/4 workers, hybrid vs stock PSS")
    mode.add_argument("--network", action="store_true",
                      help="emulated hosts with slow links: W in --network_workers (needs root)")
    mode.add_argument("--dynamic", action="store_true",
                      help="DynamicEmbedding vs a static hashed table of the same capacity")
    p.add_argument("--quick", action="store_true", help="fewer steps: whole run < 10 min")
    p.add_argument("--setups", default=None,
                   help=f"comma-separated subset of {','.join(THROUGHPUT_SETUPS)} "
                   f"(--network: of {','.join(network.NETWORK_SETUPS)}); default all")
    p.add_argument("--global_batch", type=int, default=1024)
    p.add_argument("--steps_per_execution", type=int, default=8)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per setup (default 256, quick 64)")
    p.add_argument("--warmup_steps", type=int, default=None,
                   help="untimed steps first; also the epoch length (default 64, quick 32)")
    p.add_argument("--pool_batches", type=int, default=None,
                   help="distinct cached batches per reader (default 32, quick 16)")
    p.add_argument("--vocab_size", type=int, default=100_000)
    p.add_argument("--embedding_dim", type=int, default=16)
    p.add_argument("--variant", default="baseline",
                   choices=("baseline", "fused", "dedup", "fused_dedup", "multitable", "hashed",
                            "dynamic", "local_rows", "no_push"),
                   help="model variant (see benchmarks/model.py)")
    p.add_argument("--mixed_precision", default="float32",
                   help=f"comma-separated Keras policies, each run side by side: "
                        f"{','.join(POLICIES)} (mixed_float16 needs --optimizer adagrad, sgd or sgd_noslot)")
    p.add_argument("--table_dtype", default="float32",
                   help=f"comma-separated dtypes the hybrid setups store their tables in "
                        f"(HybridOptions.table_dtype), each run side by side: "
                        f"{','.join(TABLE_DTYPES)} (half precision needs --optimizer adagrad, "
                        f"sgd or sgd_noslot)")
    p.add_argument("--dense_bucket_bytes", type=int, default=None,
                   help="the hybrid setups' HybridOptions.dense_bucket_bytes (0: one packed "
                        "all-reduce of the dense gradients; default: the strategy's)")
    p.add_argument("--dense_allreduce_dtype", default="none",
                   help=f"comma-separated HybridOptions.dense_allreduce_dtype values of the "
                        f"hybrid setups: {','.join(ALLREDUCE_DTYPES)} (none: the dense "
                        f"gradients in their own dtype); several only with --network, each "
                        f"run side by side")
    p.add_argument("--optimizer", default="legacy_adagrad", choices=sorted(OPTIMIZER_NAMES),
                   help="legacy_adagrad: tf.keras.optimizers.legacy.Adagrad (the default); "
                        "adagrad / sgd: Keras's new Adagrad / SGD (which makes a float32 "
                        "momentum slot even with momentum=0), lr 0.05; sgd_noslot: Keras's SGD "
                        "without that slot (benchmarks/model.py's SlotlessSGD)")
    p.add_argument("--track_rows", action="store_true",
                   help="hybrid setups track updated table rows for incremental checkpoints "
                        "(ChiefCheckpointManager(full_every_saves=...)), to measure its step-time "
                        "cost")
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--num_ps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the setup list this many times round-robin; report medians")
    p.add_argument("--memory_rows", default=",".join(str(r) for r in DEFAULT_MEMORY_ROWS),
                   help="table sizes (rows) for --memory")
    p.add_argument("--memory_steps", type=int, default=5)
    p.add_argument("--scaling_workers", default="1,2,4")
    p.add_argument("--balance_batches", type=int, default=50)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per setup")
    p.add_argument("--log_dir", default=None, help="child logs (default: a temp dir)")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    net = p.add_argument_group("--network")
    net.add_argument("--link_mbit", type=float, default=50.0,
                     help="every host's link rate, Mbit/s each direction")
    net.add_argument("--network_workers", default=None,
                     help="worker counts (default 2,4,8; quick 2,8)")
    net.add_argument("--per_worker_batch", type=int, default=256)
    net.add_argument("--hidden", default=",".join(str(h) for h in network.DLRM_TOP_MLP),
                     help="MLP widths for --network (default: DLRM's top MLP)")
    net.add_argument("--network_steps", type=int, default=None,
                     help="steps per epoch (hybrid; stock PSS runs W times as many; "
                          "default 16, quick 8)")
    net.add_argument("--network_spe", type=int, default=4, help="steps_per_execution")
    net.add_argument("--network_epochs", type=int, default=None,
                     help="timed epochs after the warm-up epoch (default 2, quick 1)")
    dyn = p.add_argument_group("--dynamic")
    dyn.add_argument("--capacity", type=int, default=262_144,
                     help="rows of the one table, hashed or dynamic")
    dyn.add_argument("--admit_after", type=int, default=1, help="the dynamic table's admit_after")
    dyn.add_argument("--heldout_batches", type=int, default=8,
                     help="held-out batches (per-worker batch size) for the AUC")
    p.add_argument("--chart", default=None,
                   help="PNG chart path (default none): bars per setup for a throughput "
                        "run, lines over workers for --network")
    p.add_argument("--plugin_path", default=None,
                   help="measure the tf_psplugin package found in this directory instead "
                        "(e.g. a patched copy); the chief imports it first")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and completes the arguments (defaults that depend on --quick)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    if args.warmup_steps is None:
        args.warmup_steps = 32 if quick else 64
    if args.steps is None:
        args.steps = 64 if quick else 256
    if args.pool_batches is None:
        args.pool_batches = 16 if quick else 32
    known = network.NETWORK_SETUPS if args.network else THROUGHPUT_SETUPS
    if args.setups is None:
        # --network --quick: the two setups its targets compare, W = 2 and 8
        # (~10 min; every setup at W = 2, 4, 8 takes ~26 min on this box).
        args.setups = ",".join(network.QUICK_SETUPS if args.network and quick else known)
    setups = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(setups) - set(known))
    if unknown:
        parser.error(f"unknown setups {unknown}; choose from {','.join(known)}")
    args.setup_list = setups
    spe = args.steps_per_execution
    if spe < 1 or args.warmup_steps % spe or args.steps % args.warmup_steps:
        parser.error("--warmup_steps must be a multiple of --steps_per_execution and --steps a "
                     "multiple of --warmup_steps (an epoch is --warmup_steps long)")
    if args.pool_batches > args.warmup_steps:
        parser.error("--pool_batches must be <= --warmup_steps, so the cached pool is full "
                     "before timing starts")
    if args.global_batch % args.num_workers:
        parser.error("--global_batch must be divisible by --num_workers")
    args.policy_list = _choices(parser, "--mixed_precision", args.mixed_precision, POLICIES)
    args.table_dtype_list = _choices(parser, "--table_dtype", args.table_dtype, TABLE_DTYPES)
    args.allreduce_dtype_list = [
        None if d == "none" else d for d in _choices(
            parser, "--dense_allreduce_dtype", args.dense_allreduce_dtype, ALLREDUCE_DTYPES)]
    if len(args.allreduce_dtype_list) > 1 and not args.network:
        parser.error("--dense_allreduce_dtype: several values only with --network; give one")
    _check_precision(parser, args)
    args.memory_row_list = [int(r) for r in args.memory_rows.split(",") if r]
    args.scaling_worker_list = [int(w) for w in args.scaling_workers.split(",") if w]
    if args.network_workers is None:
        args.network_workers = "2,8" if quick else "2,4,8"
    args.network_workers = [int(w) for w in args.network_workers.split(",") if w]
    args.hidden = [int(h) for h in str(args.hidden).split(",") if h]
    if args.network_steps is None:
        args.network_steps = 8 if quick else 16
    if args.network_epochs is None:
        args.network_epochs = 1 if quick else 2
    if args.network_steps % args.network_spe:
        parser.error("--network_steps must be a multiple of --network_spe")
    return args


def _choices(parser, flag: str, text: str, known: Sequence[str]) -> List[str]:
    """A comma-separated list of `known` values, in order, without repeats."""
    values = list(dict.fromkeys(v for v in text.split(",") if v))
    unknown = [v for v in values if v not in known]
    if unknown or not values:
        parser.error(f"{flag}: {unknown or 'nothing'} not known; give a comma-separated "
                     f"list of {','.join(known)}")
    return values


def _check_precision(parser, args) -> None:
    """Refuses the policy / table dtype / setup combinations that cannot run."""
    half = [d for d in args.table_dtype_list if d != "float32"]
    if args.optimizer == "legacy_adagrad" and ("mixed_float16" in args.policy_list or half):
        what = "--mixed_precision mixed_float16" if "mixed_float16" in args.policy_list else (
            f"--table_dtype {half[0]}")
        parser.error(f"{what} needs one of Keras's new optimizers (a legacy optimizer is "
                     f"refused, docs/mixed_precision.md); add --optimizer adagrad")
    other_mode = next((m for m in ("memory", "network", "scaling", "balance", "dynamic")
                       if getattr(args, m)), None)
    if other_mode and args.policy_list != ["float32"]:
        parser.error(f"--mixed_precision applies to the throughput mode only; drop it from "
                     f"--{other_mode}")
    if other_mode in ("scaling", "balance", "dynamic") and args.table_dtype_list != ["float32"]:
        parser.error(f"--table_dtype applies to the throughput, --memory and --network modes; "
                     f"drop it from --{other_mode}")
    if "mixed_float16" in args.policy_list:
        refused = [s for s in args.setup_list if s in ("stock_pss", "hybrid_async")]
        if refused:
            parser.error(f"--mixed_precision mixed_float16 cannot run setups {refused} "
                         f"(Keras refuses loss scaling with asynchronous updates); drop them "
                         f"from --setups")


def variants(args) -> List[tuple]:
    """Every (setup, policy, table_dtype) to run, in order: policies, then dtypes, then setups.

    Only the plugin's setups store tables in half precision: the others run
    once per policy.
    """
    out = []
    for policy in args.policy_list:
        for table_dtype in args.table_dtype_list:
            for setup in args.setup_list:
                if table_dtype == "float32" or setup.startswith("hybrid"):
                    out.append((setup, policy, table_dtype))
    return out


def knobs(args) -> Dict[str, object]:
    """The settings every setup shares, stated in every output line."""
    return {"steps_per_execution": args.steps_per_execution, "warmup_steps": args.warmup_steps,
            "pool_batches": args.pool_batches,
            "optimizer": f"{OPTIMIZER_NAMES[getattr(args, 'optimizer', 'legacy_adagrad')]}"
                         f"({LEARNING_RATE:g})",
            "variant": args.variant, "vocab_size": args.vocab_size,
            "embedding_dim": args.embedding_dim, "mlp": [512, 256, 128, 1],
            "num_tables": 26, "input": "SyntheticCTR pool, cached, repeated",
            "threads": "TF defaults", "track_rows": bool(getattr(args, "track_rows", False))}


def model_dict(args, vocab_size: Optional[int] = None, variant: Optional[str] = None) -> dict:
    return {"vocab_size": vocab_size or args.vocab_size, "embedding_dim": args.embedding_dim,
            "variant": variant or args.variant, "capacity": args.capacity,
            "admit_after": args.admit_after,
            "optimizer": getattr(args, "optimizer", "legacy_adagrad")}


def job_for(setup: str, args, num_workers: int, model: Optional[dict] = None,
            steps: Optional[int] = None, warmup: Optional[int] = None,
            spe: Optional[int] = None, pool: Optional[int] = None,
            policy: str = "float32", table_dtype: str = "float32") -> dict:
    """The JSON job a child process runs (see benchmarks/child.py).

    `policy` is the Keras policy the child sets (``mixed_precision``);
    `table_dtype` the hybrid setups' HybridOptions.table_dtype ("float32":
    the default).
    """
    warmup = warmup or args.warmup_steps
    steps = steps or args.steps
    role = {"single": "single", "mwms": "mwms_worker"}.get(setup, "ps_chief")
    return {
        "role": role, "setup": setup, "model": model or model_dict(args),
        "global_batch": args.global_batch, "num_workers": num_workers, "num_ps": args.num_ps,
        "steps_per_execution": spe or args.steps_per_execution, "steps_per_epoch": warmup,
        "timed_epochs": steps // warmup, "pool_batches": pool or args.pool_batches,
        "embedding_updates": "async" if setup == "hybrid_async" else "sync",
        "stack_tables": setup != "hybrid_sync_unstacked",
        "track_rows": bool(getattr(args, "track_rows", False)),
        "partition_min_bytes": 1 << 20,
        "mixed_precision": policy, "table_dtype": table_dtype,
        "dense_bucket_bytes": getattr(args, "dense_bucket_bytes", None),
        "dense_allreduce_dtype": (getattr(args, "allreduce_dtype_list", [None])[0]
                                  if setup in HYBRID_SETUPS else None),
    }


def run_job(job: dict, args, num_workers: int, log_dir: str) -> dict:
    """Runs one setup in its own processes; returns the raw child result or an error."""
    start = time.monotonic()
    load_start = os.getloadavg()[0]
    try:
        if job["role"] == "single":
            result = procs.run_single(job, log_dir, args.timeout)
        elif job["role"] == "mwms_worker":
            result = procs.run_mwms(job, num_workers, log_dir, args.timeout)
        else:
            result = procs.run_ps_cluster(job, num_workers, args.num_ps, log_dir, args.timeout)
        result["status"] = "ok"
    except procs.BenchmarkProcessError as e:
        result = {"status": "error", "error": str(e)[-2000:], "examples_per_sec": None,
                  "peak_rss_mb": {}}
    result["wall_seconds"] = round(time.monotonic() - start, 1)
    result["loadavg_start"] = round(load_start, 2)
    cpu = sum(result.get("timed_cpu_seconds", {}).values())
    if result.get("examples_per_sec") and cpu > 0:
        examples = result["examples_per_sec"] * result["timed_seconds"]
        result["examples_per_cpu_sec"] = examples / cpu
    return result


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def throughput_records(runs: Dict[tuple, List[dict]], args, num_workers: int) -> List[dict]:
    """One output record per (setup, policy, table_dtype) (medians over repeats), with ratios.

    Args:
        runs: Results by `variants` key, or by setup name alone (float32).

    The ratios to single and stock PSS compare within one policy (their
    float32-table runs); ``ratio_to_float32`` is to the same setup under
    float32 with float32 tables.
    """
    runs = {(k, "float32", "float32") if isinstance(k, str) else tuple(k): v
            for k, v in runs.items()}
    eps, cpu_eff = {}, {}
    for key, results in runs.items():
        ok = [r for r in results if r.get("status") == "ok"]
        eps[key] = statistics.median(r["examples_per_sec"] for r in ok) if ok else None
        eff = [r["examples_per_cpu_sec"] for r in ok if r.get("examples_per_cpu_sec")]
        cpu_eff[key] = statistics.median(eff) if eff else None
    records = []
    for key, results in runs.items():
        setup, policy, table_dtype = key
        single = ("single", policy, "float32")
        stock = ("stock_pss", policy, "float32")
        base = (setup, "float32", "float32")
        ok = [r for r in results if r.get("status") == "ok"]
        last = ok[-1] if ok else results[-1]
        job = job_for(setup, args, num_workers, policy=policy, table_dtype=table_dtype)
        rec = {
            "mode": "throughput",
            "setup": setup,
            "policy": policy,
            "table_dtype": table_dtype if setup in HYBRID_SETUPS else None,
            "examples_per_sec": round(eps[key], 1) if eps[key] else None,
            "ratio_to_single": _ratio(eps[key], eps.get(single)),
            "ratio_to_stock_pss": _ratio(eps[key], eps.get(stock)),
            "ratio_to_float32": _ratio(eps[key], eps.get(base)) if key != base else None,
            "peak_rss_mb": {k: round(v, 1) for k, v in last.get("peak_rss_mb", {}).items()},
            "steps": last.get("timed_steps", args.steps),
            "global_batch": args.global_batch,
            "tf_version": last.get("tf_version"),
            "status": "ok" if ok else "error",
            "num_workers": 1 if setup == "single" else num_workers,
            "num_ps": args.num_ps if setup in ("stock_pss",) + HYBRID_SETUPS else 0,
            "per_worker_batch": last.get("per_worker_batch", args.global_batch),
            # The bucket size the strategy chose (dense_bucket_bytes None: by the hosts).
            "dense_bucket_bytes_used": last.get("dense_bucket_bytes_used"),
            "runs_examples_per_sec": [round(r["examples_per_sec"], 1) for r in ok],
            # Contention-robust companion figure: examples per CPU-second of
            # all the setup's processes during the timed steps.
            "examples_per_cpu_sec": round(cpu_eff[key], 1) if cpu_eff[key] else None,
            "cpu_ratio_to_single": _ratio(cpu_eff[key], cpu_eff.get(single)),
            "cpu_ratio_to_stock_pss": _ratio(cpu_eff[key], cpu_eff.get(stock)),
            "cpu_ratio_to_float32": (_ratio(cpu_eff[key], cpu_eff.get(base))
                                     if key != base else None),
            "timed_cpu_seconds": {k: round(v, 2) for k, v in
                                  last.get("timed_cpu_seconds", {}).items()},
            "loadavg_start": [r.get("loadavg_start") for r in results],
            "epoch_examples_per_sec": [round(x, 1) for x in last.get("epoch_examples_per_sec", [])],
            "knobs": knobs(args),
            # The plugin's strategy arguments for this setup (None: not the plugin).
            "strategy_options": (procs.strategy_options(job) if setup in HYBRID_SETUPS
                                 else None),
        }
        if not ok:
            rec["error"] = last.get("error")
        records.append(rec)
    return records


def throughput_table(records: List[dict]) -> str:
    lines = [f"{'setup':14s} {'examples/s':>11s} {'x single':>9s} {'x stock_pss':>11s} "
             f"{'ex/cpu-s':>9s} {'x single':>9s}  peak RSS MiB (role: MiB)"]

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for r in records:
        rss = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items())
        label = report.record_label(r)
        lines.append(
            f"{label:14s} {fmt(r['examples_per_sec'], '.0f'):>11s} "
            f"{fmt(r['ratio_to_single'], '.2f'):>9s} {fmt(r['ratio_to_stock_pss'], '.2f'):>11s} "
            f"{fmt(r['examples_per_cpu_sec'], '.0f'):>9s} "
            f"{fmt(r['cpu_ratio_to_single'], '.2f'):>9s}  {rss}")
    return "\n".join(lines)


def mode_throughput(args, log_dir: str, emit) -> List[dict]:
    runs: Dict[tuple, List[dict]] = {v: [] for v in variants(args)}
    for _ in range(args.repeats):
        for key in runs:
            setup, policy, table_dtype = key
            job = job_for(setup, args, args.num_workers, policy=policy, table_dtype=table_dtype)
            runs[key].append(run_job(job, args, args.num_workers, log_dir))
            _progress(f"{report.variant_label(*key)}: {_short(runs[key][-1])}")
    records = throughput_records(runs, args, args.num_workers)
    for r in records:
        emit(r)
    _table(throughput_table(records))
    if args.chart:
        report.throughput_chart(records, args.chart,
                                title=f"{args.global_batch} examples per step, "
                                      f"{args.num_workers} workers, {args.num_ps} PS")
    return records


def mode_scaling(args, log_dir: str, emit) -> List[dict]:
    ncpu = os.cpu_count() or 1
    records = []
    for n in args.scaling_worker_list:
        if args.global_batch % n:
            continue
        runs = {}
        for setup in ("stock_pss", "hybrid_sync"):
            runs[setup] = [run_job(job_for(setup, args, n), args, n, log_dir)]
            _progress(f"scaling {setup} x{n}: {_short(runs[setup][-1])}")
        for rec in throughput_records(runs, args, n):
            processes = 1 + n + args.num_ps
            rec.update({"mode": "scaling", "num_workers": n, "processes": processes,
                        "cpus": ncpu, "oversubscribed": processes > ncpu,
                        "note": f"{processes} TF processes on {ncpu} cores"})
            records.append(rec)
            emit(rec)
    base = {r["setup"]: r["examples_per_sec"] for r in records if r["num_workers"] == 1}
    lines = [f"{'setup':12s} {'workers':>7s} {'examples/s':>11s} {'x 1 worker':>10s}  note"]
    for r in records:
        eps = r["examples_per_sec"]
        lines.append(f"{r['setup']:12s} {r['num_workers']:7d} "
                     f"{(f'{eps:.0f}' if eps else 'error'):>11s} "
                     f"{(_ratio(eps, base.get(r['setup'])) or '-')!s:>10s}  {r['note']}")
    _table("\n".join(lines))
    return records


def _memory_record(args, log_dir: str, rows: int, table_dtype: str, steps: int, spe: int,
                   slot_bytes: int) -> dict:
    """One --memory run: hybrid sync with one table of about `rows` rows in `table_dtype`."""
    vocab = -(-rows // 26)
    model = model_dict(args, vocab_size=vocab, variant="fused")
    job = job_for("hybrid_sync", args, args.num_workers, model=model, steps=steps,
                  warmup=steps, spe=spe, pool=4, table_dtype=table_dtype)
    result = run_job(job, args, args.num_workers, log_dir)
    table_rows = vocab * 26
    table_bytes = table_rows * args.embedding_dim * DTYPE_BYTES[table_dtype]
    slots = table_rows * args.embedding_dim * slot_bytes
    share = (table_bytes + slots) / args.num_ps / 2**20  # Table + optimizer slots, per PS.
    peaks = result.get("peak_rss_mb", {})
    base = result.get("baseline_rss_mb", {})
    ps_roles = sorted(r for r in peaks if r.startswith("ps"))
    rows_per_ps = table_rows / args.num_ps
    rec = {
        "mode": "memory", "setup": "hybrid_sync", "status": result["status"],
        "table_dtype": table_dtype, "optimizer": knobs(args)["optimizer"],
        "table_rows": table_rows, "embedding_dim": args.embedding_dim,
        "table_mb": round(table_bytes / 2**20, 1),
        "table_plus_slots_per_ps_mb": round(share, 1),
        "peak_rss_mb": {k: round(v, 1) for k, v in peaks.items()},
        "baseline_rss_mb": {k: round(v, 1) for k, v in base.items()},
        "ps_peak_over_share": {r: round(peaks[r] / share, 3) for r in ps_roles},
        "ps_growth_over_share": {r: round((peaks[r] - base.get(r, 0.0)) / share, 3)
                                 for r in ps_roles},
        # What a row costs a PS: its peak RSS above the idle server, per row it holds.
        "ps_growth_bytes_per_row": {r: round((peaks[r] - base.get(r, 0.0)) * 2**20
                                             / rows_per_ps, 1) for r in ps_roles},
        "steps": steps, "global_batch": args.global_batch,
        "tf_version": result.get("tf_version"),
        "strategy_options": procs.strategy_options(job),
    }
    if result["status"] != "ok":
        rec["error"] = result.get("error")
    return rec


def mode_memory(args, log_dir: str, emit) -> List[dict]:
    records = []
    spe = 1
    steps = max(args.memory_steps, 1)
    # Adagrad's accumulator and Keras's SGD's momentum (made even with momentum=0)
    # are float32, also for half-precision tables; sgd_noslot has no slot.
    slot_bytes = 0 if args.optimizer == "sgd_noslot" else 4
    for table_dtype in args.table_dtype_list:
        for rows in args.memory_row_list:
            records.append(_memory_record(args, log_dir, rows, table_dtype, steps, spe,
                                          slot_bytes))
            emit(records[-1])
            _progress(f"memory {rows} {table_dtype}: {records[-1]['peak_rss_mb']}")
    ok = [r for r in records if r["status"] == "ok"]
    summary = {"mode": "memory_summary", "sizes": [r["table_rows"] for r in ok]}
    if ok:
        workers = sorted({k for r in ok for k in r["peak_rss_mb"] if k.startswith("worker")})
        spread = {}
        for w in workers:
            vals = [r["peak_rss_mb"][w] for r in ok if w in r["peak_rss_mb"]]
            spread[w] = round(max(vals) / min(vals) - 1.0, 3)
        summary["worker_peak_spread"] = spread
        summary["worker_within_10pct"] = all(v <= TARGETS["memory_worker_spread"]
                                             for v in spread.values())
        # By size (and table dtype, when several were measured).
        size = ((lambda r: r["table_rows"]) if len(args.table_dtype_list) == 1 else
                (lambda r: f"{r['table_dtype']} {r['table_rows']}"))
        summary["ps_peak_within_1_3x_share"] = {
            size(r): all(v <= TARGETS["memory_ps_over_share"]
                         for v in r["ps_peak_over_share"].values()) for r in ok}
        summary["ps_growth_within_1_3x_share"] = {
            size(r): all(v <= TARGETS["memory_ps_over_share"]
                         for v in r["ps_growth_over_share"].values()) for r in ok}
        if len(args.table_dtype_list) > 1:
            # Same size, half-precision tables against float32: PS growth per row.
            per_row = {(r["table_dtype"], r["table_rows"]):
                       max(r["ps_growth_bytes_per_row"].values()) for r in ok}
            summary["ps_growth_per_row_over_float32"] = {
                f"{d} {rows}": round(v / per_row[("float32", rows)], 3)
                for (d, rows), v in per_row.items()
                if d != "float32" and per_row.get(("float32", rows))}
    emit(summary)
    lines = [f"{'rows':>11s} {'table':>8s} {'share/PS MiB':>12s}  peak RSS MiB by role  |  "
             f"PS peak/share, (peak-baseline)/share, (peak-baseline) bytes/row"]
    for r in records:
        rss = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items()) or r.get("error", "")
        lines.append(f"{r['table_rows']:11d} {r['table_dtype']:>8s} "
                     f"{r['table_plus_slots_per_ps_mb']:12.0f}  {rss}  |  "
                     f"{r['ps_peak_over_share']}  {r['ps_growth_over_share']}  "
                     f"{r['ps_growth_bytes_per_row']}")
    _table("\n".join(lines))
    return records


def mode_balance(args, emit) -> List[dict]:
    from benchmarks import balance  # pylint: disable=g-import-not-at-top

    records = balance.measure(num_rows=args.vocab_size, batch=args.global_batch,
                              num_batches=args.balance_batches)
    for r in records:
        emit(r)
    _table(balance.format_table(records))
    return records


def _short(result: dict) -> str:
    if result.get("status") != "ok":
        return "error: " + (result.get("error") or "")[:300]
    return f"{result['examples_per_sec']:.0f} examples/s ({result.get('wall_seconds', '?')} s wall)"


def _progress(msg: str) -> None:
    sys.stderr.write(f"[benchmarks] {msg}\n")
    sys.stderr.flush()


def _table(text: str) -> None:
    sys.stderr.write("\n" + text + "\n\n")
    sys.stderr.flush()


def plugin_revision() -> str:
    """Which tf_psplugin is measured: git commit (+dirty), content hash, location.

    That is the repo's, or the patched copy given with --plugin_path.
    """
    import hashlib  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top

    root = procs.plugin_root()
    digest = hashlib.sha1()
    pkg = os.path.join(root, "tf_psplugin")
    for dirpath, _, files in sorted(os.walk(pkg)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    digest.update(f.read())
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "tf_psplugin"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    return (f"{head or 'no-git'}{'+dirty' if dirty else ''} "
            f"sha1:{digest.hexdigest()[:10]} ({root})")


def machine_info() -> dict:
    mem_gib = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {"nproc": os.cpu_count(), "mem_gib": mem_gib, "plugin": plugin_revision(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": sys.version.split()[0]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.plugin_path:
        os.environ[procs.PLUGIN_PATH_ENV] = os.path.abspath(args.plugin_path)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_bench_")
    os.makedirs(log_dir, exist_ok=True)
    out_file = open(args.output, "a", encoding="utf-8") if args.output else None  # noqa: SIM115

    machine = machine_info()
    machine["log_dir"] = log_dir

    def emit(record: dict) -> None:
        line = json.dumps(dict(record, machine=machine))
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        if out_file:
            out_file.write(line + "\n")
            out_file.flush()

    try:
        if args.balance:
            mode_balance(args, emit)
        elif args.memory:
            mode_memory(args, log_dir, emit)
        elif args.scaling:
            mode_scaling(args, log_dir, emit)
        elif args.network:
            network.mode_network(args, log_dir, emit)
        elif args.dynamic:
            dynamic.mode_dynamic(args, log_dir, emit, job_for, model_dict, run_job,
                                 _progress, _table)
        else:
            mode_throughput(args, log_dir, emit)
    finally:
        if out_file:
            out_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
