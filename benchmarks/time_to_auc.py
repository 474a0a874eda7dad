"""`python -m benchmarks.time_to_auc`: wall clock until the demo's held-out AUC reaches a target.

Why this module exists: users compare strategies by how soon a model
reaches its quality, and examples/s says that only when every setup learns
the same amount per example. This benchmark trains the demo's CTR model
(`keras_examples/ctr.py`, what `make demo` trains, on its generated data)
under hybrid sync (the strategy's defaults), hybrid async
(``embedding_updates="async"``) and stock ParameterServerStrategy, on
emulated hosts with slow links (as ``benchmarks.run --network``: every task
its own network namespace, a token-bucket link of ``--link_mbit`` each way)
or on loopback (``--hosts loopback``, no root, for the smoke test), and
records the training clock at which the held-out AUC first reaches
``--target_auc``.

    sudo .venv/bin/python -m benchmarks.time_to_auc --workers 2 --max_seconds 240
    sudo .venv/bin/python -m benchmarks.time_to_auc --workers 8

Comparison rule (same for every setup): per-worker batch ``--per_worker_batch``
(the demo's 256), so a global step is W x 256 examples; legacy Adagrad at
``--learning_rate`` (the demo's 0.3) on the batch-mean loss. Hybrid sync
applies one update per global step (exact global-batch SGD, as one process
with W x 256 examples per step and the same rate); hybrid async all-reduces
the dense gradients and lets each worker push its own table gradient; stock
PSS's workers each apply their own 256-example batch asynchronously, W
updates per global step's examples, at the same rate (Adagrad normalises
the step size by the accumulated squared gradient, so a batch-mean gradient
of 256 examples takes the same rate as one of W x 256). ``--lr_rule sqrt``
scales the hybrid setups' rate by sqrt(W) instead (the square-root rule for
a W times larger batch), stock PSS's stays the base rate; every line records
the rate each setup ran with. Every setup is scored after the same number of
examples: every ``--eval_every_steps`` global steps (stock PSS: W times as
many one-worker steps). Every worker generates only its own batches
(``--hybrid_input self_sharded``, the default; see benchmarks/auc_chief.py).

Clock: training time only. It runs from each epoch's begin to its end (Keras
joins every scheduled step there), so evaluation time, which copies the
weights to the chief over its link, is not on it (``eval_seconds`` per
line); the first epoch includes tracing the step; start-up (connecting,
building the model) is recorded apart (``startup_seconds``). The time to
target is the clock at the first evaluation at or above it: an upper bound,
at most one evaluation interval late. Each setup stops at the target or
once its clock passes ``--max_seconds`` ("not reached").

Output: JSON lines on stdout: one ``time_to_auc_run`` line (every option),
one ``time_to_auc_eval`` line per evaluation (setup, seconds, steps,
examples, auc), one ``time_to_auc_summary`` per setup (seconds_to_target,
ratios to stock PSS); and ``<results_dir>/<name>.{jsonl,md,png}`` (``name``
defaults to ``<date>-time-to-auc``).
"""

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from benchmarks import procs

SETUPS = ("hybrid_sync", "hybrid_async", "stock_pss")
LR_RULES = ("same", "sqrt")
BASELINE = "stock_pss"
EVAL_PREFIX = "AUC_EVAL "
PORT = 2222  # Every emulated host has its own port space.
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# -- Pure arithmetic (tests/unit/test_time_to_auc.py) --------------------------


def auc(labels: Sequence[float], scores: Sequence[float]) -> float:
    """Exact ROC AUC (Mann-Whitney), ties counted half.

    Args:
        labels: 0/1 per example.
        scores: Any monotone score per example (logits or probabilities).

    Returns:
        The AUC in [0, 1].

    Raises:
        ValueError: If the lengths differ or one class is missing.
    """
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} vs {s.size}")
    pos = int(np.sum(y > 0.5))
    neg = y.size - pos
    if pos == 0 or neg == 0:
        raise ValueError(f"AUC needs both classes; got {pos} positive, {neg} negative examples")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # Average 1-based rank of each distinct score (ties share it).
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0
    ranks = average_rank[inverse]
    return float((ranks[y > 0.5].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def first_crossing(evals: Sequence[dict], target: float) -> Optional[dict]:
    """The first evaluation (in clock order) whose ``auc`` is at least `target`; None if none."""
    for record in sorted(evals, key=lambda r: r["seconds"]):
        if record["auc"] >= target:
            return record
    return None


def summarize(evals: Sequence[dict], target: float, max_seconds: float,
              baseline: str = BASELINE, milestones: Sequence[float] = ()) -> List[dict]:
    """One summary per (setup, workers): time to target and ratios to the baseline's.

    Args:
        evals: ``time_to_auc_eval`` records (``setup``, ``num_workers``,
            ``seconds``, ``steps``, ``examples``, ``auc``).
        target: The AUC to reach.
        max_seconds: The clock cap each setup ran with.
        baseline: The setup the ratios divide by.
        milestones: Lower AUCs whose first crossing is recorded too
            (``seconds_to`` and ``examples_to``, keyed by the AUC as text):
            setups that all miss the target still compare there.

    Returns:
        Records with ``seconds_to_target`` (None: not reached),
        ``examples_to_target``, ``max_auc``, ``final_auc``, ``train_seconds``
        (the last evaluation's clock) and, against the baseline at the same
        W: ``ratio_to_stock_pss`` (seconds / baseline's seconds, both
        reached), or, when only this setup reached it,
        ``ratio_to_stock_pss_at_most`` (seconds / the baseline's whole clock,
        which had not reached the target), and the same for examples.
    """
    groups: Dict[tuple, List[dict]] = {}
    for record in evals:
        groups.setdefault((record["num_workers"], record["setup"]), []).append(record)
    out = {}
    def order(key):
        w, setup = key
        return (w, SETUPS.index(setup) if setup in SETUPS else len(SETUPS), setup)

    for (w, setup), rows in sorted(groups.items(), key=lambda item: order(item[0])):
        rows = sorted(rows, key=lambda r: r["seconds"])
        hit = first_crossing(rows, target)
        out[(w, setup)] = {
            "kind": "time_to_auc_summary", "setup": setup, "num_workers": w,
            "target_auc": target, "max_seconds": max_seconds, "reached": hit is not None,
            "seconds_to_target": hit["seconds"] if hit else None,
            "steps_to_target": hit["steps"] if hit else None,
            "examples_to_target": hit["examples"] if hit else None,
            "max_auc": max(r["auc"] for r in rows), "final_auc": rows[-1]["auc"],
            "train_seconds": rows[-1]["seconds"], "examples_trained": rows[-1]["examples"],
            "evaluations": len(rows),
        }
        if milestones:
            hits = {f"{m:g}": first_crossing(rows, m) for m in milestones}
            out[(w, setup)]["seconds_to"] = {k: h["seconds"] if h else None
                                             for k, h in hits.items()}
            out[(w, setup)]["examples_to"] = {k: h["examples"] if h else None
                                              for k, h in hits.items()}
    for (w, setup), record in out.items():
        base = out.get((w, baseline))
        record.update(ratio_to_stock_pss=None, ratio_to_stock_pss_at_most=None,
                      examples_ratio_to_stock_pss=None,
                      examples_ratio_to_stock_pss_at_most=None)
        if base is None or not record["reached"]:
            continue
        if base["reached"]:
            record["ratio_to_stock_pss"] = round(
                record["seconds_to_target"] / base["seconds_to_target"], 3)
            record["examples_ratio_to_stock_pss"] = round(
                record["examples_to_target"] / base["examples_to_target"], 3)
        else:
            record["ratio_to_stock_pss_at_most"] = round(
                record["seconds_to_target"] / base["train_seconds"], 3)
            record["examples_ratio_to_stock_pss_at_most"] = round(
                record["examples_to_target"] / base["examples_trained"], 3)
    return list(out.values())


# -- Arguments -------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.time_to_auc",
        description="Wall clock until the demo's held-out AUC reaches a target, per setup.")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help=f"comma-separated, of {','.join(SETUPS)} (default all)")
    p.add_argument("--workers", default="2", help="comma-separated worker counts, e.g. 2,8")
    p.add_argument("--num_ps", type=int, default=2)
    p.add_argument("--hosts", choices=("emulated", "loopback"), default="emulated",
                   help="emulated: one network namespace per task (root); loopback: 127.0.0.1")
    p.add_argument("--link_mbit", type=float, default=50.0,
                   help="emulated hosts' link rate each way, Mbit/s (0: unlimited)")
    p.add_argument("--per_worker_batch", type=int, default=256, help="the demo's --batch_size")
    p.add_argument("--learning_rate", type=float, default=0.3, help="legacy Adagrad's rate")
    p.add_argument("--lr_rule", choices=LR_RULES, default="same",
                   help="same: --learning_rate in every setup; sqrt: the hybrid setups (one "
                        "dense update per W x per_worker_batch examples) use --learning_rate "
                        "x sqrt(W), stock PSS (one update per worker batch) --learning_rate")
    p.add_argument("--hybrid_input", choices=("self_sharded", "auto_sharded"),
                   default="self_sharded",
                   help="self_sharded: each hybrid worker generates only its own batches, as "
                        "stock PSS's do; auto_sharded: the demo's dataset, every worker "
                        "generates every global batch and keeps its own")
    p.add_argument("--steps_per_execution", type=int, default=10)
    p.add_argument("--eval_every_steps", type=int, default=50,
                   help="global steps (W x per_worker_batch examples each) between evaluations")
    p.add_argument("--eval_examples", type=int, default=20480,
                   help="held-out examples (the demo evaluator's 20 x 1024)")
    p.add_argument("--dense_allreduce_dtype", choices=("bfloat16", "float16"), default=None,
                   help="the hybrid setups' HybridOptions.dense_allreduce_dtype (default: the "
                        "dense gradients all-reduced in their own dtype)")
    p.add_argument("--target_auc", type=float, default=0.77)
    p.add_argument("--milestones", default="0.74,0.75,0.76",
                   help="lower AUCs whose first crossing the summary records too")
    p.add_argument("--resummarize", default=None, metavar="JSONL",
                   help="no run: recompute the summaries of an earlier run's lines and "
                        "rewrite its files (the run's own options are used)")
    p.add_argument("--max_seconds", type=float, default=240.0,
                   help="training-clock cap per setup; not reached by then: 'not reached'")
    p.add_argument("--vocab_size", type=int, default=10_000)
    p.add_argument("--embedding_dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None,
                   help="wall-clock limit per setup, start-up and evaluations included "
                        "(default: 2 x max_seconds + 600)")
    p.add_argument("--results_dir", default=RESULTS_DIR,
                   help="where <name>.jsonl/.md/.png go ('' writes none)")
    p.add_argument("--name", default=None, help="file stem (default <date>-time-to-auc)")
    p.add_argument("--log_dir", default=None, help="process logs (default: a temp dir)")
    args = p.parse_args(argv)
    args.setup_list = [s for s in args.setups.split(",") if s]
    bad = [s for s in args.setup_list if s not in SETUPS]
    if bad or not args.setup_list:
        p.error(f"--setups: unknown {bad or 'empty list'}; choose from {','.join(SETUPS)}")
    try:
        args.worker_list = [int(w) for w in args.workers.split(",") if w]
    except ValueError:
        p.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if not args.worker_list or min(args.worker_list) < 1:
        p.error(f"--workers must list worker counts >= 1, got {args.workers!r}")
    for field in ("num_ps", "per_worker_batch", "steps_per_execution", "eval_every_steps",
                  "eval_examples", "vocab_size", "embedding_dim"):
        if getattr(args, field) < 1:
            p.error(f"--{field} must be >= 1, got {getattr(args, field)}")
    if args.eval_every_steps % args.steps_per_execution:
        p.error(f"--eval_every_steps ({args.eval_every_steps}) must be a multiple of "
                f"--steps_per_execution ({args.steps_per_execution}): Keras runs whole "
                "executions per epoch")
    if not 0.5 < args.target_auc < 1.0:
        p.error(f"--target_auc must be in (0.5, 1), got {args.target_auc}")
    if args.max_seconds <= 0:
        p.error(f"--max_seconds must be > 0, got {args.max_seconds}")
    if args.learning_rate <= 0:
        p.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.link_mbit < 0:
        p.error(f"--link_mbit must be >= 0 (0: unlimited), got {args.link_mbit}")
    try:
        args.milestone_list = [float(m) for m in args.milestones.split(",") if m]
    except ValueError:
        p.error(f"--milestones must be comma-separated AUCs, got {args.milestones!r}")
    if any(not 0.5 < m < 1.0 for m in args.milestone_list):
        p.error(f"--milestones must lie in (0.5, 1), got {args.milestones!r}")
    if args.timeout is None:
        args.timeout = 2 * args.max_seconds + 600
    if args.name is None:
        args.name = f"{datetime.date.today().isoformat()}-time-to-auc"
    return args


def options(args: argparse.Namespace) -> dict:
    """Every option the run used (the ``time_to_auc_run`` line)."""
    return {k: v for k, v in sorted(vars(args).items())
            if k not in ("setup_list", "worker_list", "milestone_list")}


def learning_rate(setup: str, num_workers: int, base: float, rule: str) -> float:
    """The rate a setup trains with under a rule (see ``--lr_rule``).

    "sqrt" is the square-root scaling rule for a larger batch (Krizhevsky,
    "One weird trick", 2014): the hybrid setups apply one dense update per
    global step of W worker batches, so their rate grows with sqrt(W); stock
    PSS applies each worker's batch on its own, so its rate is the base rate.
    """
    if rule not in LR_RULES:
        raise ValueError(f"lr_rule must be one of {LR_RULES}, got {rule!r}")
    if rule == "sqrt" and setup != BASELINE:
        return base * float(np.sqrt(num_workers))
    return base


def job_for(setup: str, num_workers: int, args: argparse.Namespace) -> dict:
    """The chief's job (benchmarks.auc_chief) for one setup."""
    rate = learning_rate(setup, num_workers, args.learning_rate, args.lr_rule)
    return {"setup": setup, "num_workers": num_workers, "num_ps": args.num_ps,
            "per_worker_batch": args.per_worker_batch, "learning_rate": rate,
            "hybrid_input": args.hybrid_input,
            "steps_per_execution": args.steps_per_execution,
            "eval_every_steps": args.eval_every_steps, "eval_examples": args.eval_examples,
            "target_auc": args.target_auc, "max_seconds": args.max_seconds,
            "vocab_size": args.vocab_size, "embedding_dim": args.embedding_dim,
            "seed": args.seed,
            "embedding_updates": "async" if setup == "hybrid_async" else "sync",
            "dense_allreduce_dtype": getattr(args, "dense_allreduce_dtype", None)}


def strategy_record(setup: str, dense_allreduce_dtype: Optional[str] = None) -> Optional[dict]:
    """The plugin's strategy arguments of a setup (None: stock PSS)."""
    if setup == BASELINE:
        return None
    return procs.strategy_options({"embedding_updates":
                                   "async" if setup == "hybrid_async" else "sync",
                                   "dense_allreduce_dtype": dense_allreduce_dtype})


# -- Running one setup -------------------------------------------------------------


def _chief_command(job: dict) -> List[str]:
    return [sys.executable, "-m", "benchmarks.auc_chief", json.dumps(job)]


def _eval_lines(text: str) -> List[dict]:
    return [json.loads(line[line.index(EVAL_PREFIX) + len(EVAL_PREFIX):])
            for line in text.splitlines() if EVAL_PREFIX in line]


def _tf_config(cluster: Dict[str, List[str]], task_type: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def run_emulated(job: dict, args, log_dir: str, on_eval: Callable[[dict], None]) -> dict:
    """One setup on fresh emulated hosts; every namespace and process removed after."""
    from tf_psplugin.testing import hosts as hosts_lib  # pylint: disable=g-import-not-at-top

    w, num_ps, setup = job["num_workers"], job["num_ps"], job["setup"]
    names = ["chief"] + [f"ps{i}" for i in range(num_ps)] + [f"worker{i}" for i in range(w)]
    log = os.path.join(log_dir, f"time-to-auc-{setup}-w{w}.log")
    env = procs.child_env()
    files = []
    try:
        with hosts_lib.EmulatedHosts(names, rate_mbit=args.link_mbit or None) as hosts:
            cluster = {"chief": [f"{hosts.address('chief')}:{PORT}"],
                       "worker": [f"{hosts.address(f'worker{i}')}:{PORT}" for i in range(w)],
                       "ps": [f"{hosts.address(f'ps{i}')}:{PORT}" for i in range(num_ps)]}
            for name in names[1:]:
                task_type, index = (("ps", int(name[2:])) if name.startswith("ps")
                                    else ("worker", int(name[6:])))
                out = open(os.path.join(log_dir, f"time-to-auc-{setup}-w{w}-{name}.log"), "w",
                           encoding="utf-8")  # pylint: disable=consider-using-with
                files.append(out)
                hosts.popen(name, [sys.executable, "-m", "tf_psplugin.server"],
                            env=dict(env, TF_CONFIG=_tf_config(cluster, task_type, index)),
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            out = open(log, "w", encoding="utf-8")  # pylint: disable=consider-using-with
            files.append(out)
            chief = hosts.popen("chief", _chief_command(job),
                                env=dict(env, TF_CONFIG=_tf_config(cluster, "chief", 0)),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            _follow(chief, log, args.timeout, on_eval)
    finally:
        for f in files:
            f.close()
    return _chief_result(chief, log)


def run_loopback(job: dict, args, log_dir: str, on_eval: Callable[[dict], None]) -> dict:
    """One setup on 127.0.0.1 (`tf_psplugin.launch.LocalCluster`); no root needed."""
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    w, setup = job["num_workers"], job["setup"]
    log = os.path.join(log_dir, f"time-to-auc-{setup}-w{w}-loopback.log")
    with open(log, "w", encoding="utf-8") as out:
        with LocalCluster(num_workers=w, num_ps=job["num_ps"], servers="builtin",
                          env=procs.child_env(), output=out, grace_period=2.0) as cluster:
            cluster.start_servers()
            procs.wait_until_serving(cluster, w + job["num_ps"], log,
                                     timeout=min(args.timeout, 300))
            try:
                done = cluster.run_chief(_chief_command(job), timeout=args.timeout)
            except subprocess.TimeoutExpired:
                raise procs.BenchmarkProcessError(
                    f"chief timed out after {args.timeout:.0f} s; log {log}") from None
    for record in _eval_lines(done.stdout):
        on_eval(record)
    if done.returncode != 0:
        raise procs.BenchmarkProcessError(
            f"chief exited {done.returncode}; log {log}:\n{procs._tail(log)}")  # pylint: disable=protected-access
    return procs.parse_result(done.stdout, prefix="[chief] ")


def _follow(chief: subprocess.Popen, log: str, timeout: float,
            on_eval: Callable[[dict], None]) -> None:
    """Passes the chief's evaluation lines on as they appear, until it exits or times out."""
    deadline = time.monotonic() + timeout
    seen = 0
    while True:
        done = chief.poll() is not None
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = _eval_lines(f.read())
        for record in lines[seen:]:
            on_eval(record)
        seen = len(lines)
        if done:
            return
        if time.monotonic() > deadline:
            raise procs.BenchmarkProcessError(f"chief timed out after {timeout:.0f} s; log {log}")
        time.sleep(0.5)


def _chief_result(chief: subprocess.Popen, log: str) -> dict:
    with open(log, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if chief.returncode != 0:
        raise procs.BenchmarkProcessError(
            f"chief exited {chief.returncode}; log {log}:\n{procs._tail(log)}")  # pylint: disable=protected-access
    return procs.parse_result(text)


def cpu_snapshot() -> Dict[str, float]:
    """CPU seconds so far: the whole box's busy time, and this process's with its reaped children.

    Two snapshots around a setup give the CPU other processes used meanwhile
    (`other_cpu_share`): the load average cannot tell a busy box from this
    run's own 11 processes on 2 cores. A setup's processes are reaped when it
    ends, so their CPU is in ``RUSAGE_CHILDREN`` by the second snapshot.
    """
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _, _, irq, softirq, steal = ticks
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return {"busy": (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
            "own": own, "wall": time.monotonic()}


def other_cpu_share(before: Dict[str, float], after: Dict[str, float], nproc: int) -> float:
    """The share of the box's CPU capacity that processes other than this run's used in between."""
    wall = max(after["wall"] - before["wall"], 1e-9)
    other = (after["busy"] - before["busy"]) - (after["own"] - before["own"])
    return max(other, 0.0) / (wall * max(nproc, 1))


# Other processes' share of the box's CPU above which a run is "under load".
BUSY_BOX_SHARE = 0.10


# -- Files -------------------------------------------------------------------------


def _load_verdict(load: Sequence[float], loads: Sequence[float],
                  summaries: Sequence[dict]) -> str:
    """Whether other processes shared the box: their CPU share if recorded, else the load rule."""
    under = ("**Measured under load (a shared box): the seconds are indicative; a quiet re-run "
             "is due.**")
    shares = [s["other_cpu_share"] for s in summaries if s.get("other_cpu_share") is not None]
    if shares:
        return (f"Other processes used {100 * min(shares):.0f}-{100 * max(shares):.0f}% of the "
                "box's CPU during the setups. "
                + (under if max(shares) > BUSY_BOX_SHARE else "Quiet box."))
    # Runs before `other_cpu_share` was recorded: the load average, own processes included.
    return under if max(list(load[:1]) + list(loads)) > 1.5 else "Quiet box."


def markdown(run: dict, evals: Sequence[dict], summaries: Sequence[dict]) -> str:
    """The results file: the setup, the load, one row per (W, setup)."""
    o = run["options"]
    load = run["machine"]["loadavg_at_start"]
    loads = [r["loadavg"] for r in evals if r.get("loadavg") is not None]
    lines = [
        f"# Time to held-out AUC {o['target_auc']}, {run['machine']['date']}",
        "",
        f"`python -m benchmarks.time_to_auc {' '.join(run['argv'])}`; plugin "
        f"{run['machine']['plugin']}, TensorFlow {run.get('tf_version', '?')}.",
        "",
        f"Hosts: {o['hosts']}"
        + (f", {o['link_mbit']:g} Mbit/s per host link each way" if o["hosts"] == "emulated"
           and o["link_mbit"] else "")
        + f", {o['num_ps']} PS. The demo's CTR model and data (vocab {o['vocab_size']}, dim "
        f"{o['embedding_dim']}, seed {o['seed']}), {o['per_worker_batch']} examples per worker "
        f"per step, legacy Adagrad {o['learning_rate']:g} "
        + ("in every setup" if o.get("lr_rule", "same") == "same" else
           "x sqrt(W) in the hybrid setups, the base rate in stock PSS")
        + f"; hybrid input {o.get('hybrid_input', 'auto_sharded')}; held-out AUC (exact) "
        f"on {o['eval_examples']} examples every {o['eval_every_steps']} global steps; the "
        "clock is training time (evaluations excluded, tracing included); the time to target "
        f"is the first evaluation at or above it; cap {o['max_seconds']:g} s of training per setup.",
        "",
        f"**Load**: load average {load[0]} (1 min) at the start"
        + (f", {min(loads):.1f}-{max(loads):.1f} during the evaluations" if loads else "")
        + f" on {run['machine']['nproc']} cores (this run's own processes count in it). "
        + _load_verdict(load, loads, summaries),
        "",
        "| W | setup | seconds to target | examples to target | vs stock PSS (seconds) "
        "| vs stock PSS (examples) | max AUC | train seconds | evaluations |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(record, key):
        if record.get(key) is not None:
            return f"{record[key]:.2f}x"
        if record.get(key + "_at_most") is not None:
            return f"<= {record[key + '_at_most']:.2f}x"
        return "-"

    for s in summaries:
        if s.get("error"):
            lines.append(f"| {s['num_workers']} | {s['setup']} | failed: "
                         f"{s['error'].splitlines()[0][:80]} | | | | | | |")
            continue
        reached = (f"{s['seconds_to_target']:.1f}" if s["reached"]
                   else f"not reached in {s['train_seconds']:.0f}")
        lines.append(
            f"| {s['num_workers']} | {s['setup']} | {reached} | "
            f"{s['examples_to_target'] if s['reached'] else '-'} | "
            f"{ratio(s, 'ratio_to_stock_pss')} | {ratio(s, 'examples_ratio_to_stock_pss')} | "
            f"{s['max_auc']:.4f} | {s['train_seconds']:.1f} | {s['evaluations']} |")
    marks = sorted({k for s in summaries for k in s.get("seconds_to", {})}, key=float)
    if marks:
        lines += ["", "Seconds (and thousand examples) to lower AUCs, the same runs:", "",
                  "| W | setup | " + " | ".join(f"AUC {m}" for m in marks) + " |",
                  "|---:|---|" + "---:|" * len(marks)]
        for s in summaries:
            if s.get("seconds_to"):
                cells = [f"{s['seconds_to'][m]:.1f} ({s['examples_to'][m] / 1e3:.0f}k)"
                         if s["seconds_to"][m] is not None else "-" for m in marks]
                lines.append(f"| {s['num_workers']} | {s['setup']} | " + " | ".join(cells) + " |")
    lines += ["", f"Lines: `{run['name']}.jsonl`; chart: `{run['name']}.png`.", ""]
    return "\n".join(lines)


def write_chart(evals: Sequence[dict], target: float, path: str) -> Optional[str]:
    """AUC against training seconds and examples, a line per (setup, W); None without matplotlib."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        sys.stderr.write("[time_to_auc] no chart: pip install -e .[bench] for matplotlib\n")
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = dict(zip(SETUPS, ("tab:green", "tab:orange", "tab:blue")))
    styles = ["-", "--", ":", "-."]
    workers = sorted({r["num_workers"] for r in evals})
    for setup in SETUPS:
        for i, w in enumerate(workers):
            rows = sorted((r for r in evals if r["setup"] == setup and r["num_workers"] == w),
                          key=lambda r: r["seconds"])
            if rows:
                style = dict(marker=".", color=colors[setup], linestyle=styles[i % len(styles)],
                             label=f"{setup} W={w}")
                ax.plot([r["seconds"] for r in rows], [r["auc"] for r in rows], **style)
                ax2.plot([r["examples"] / 1e3 for r in rows], [r["auc"] for r in rows], **style)
    for a in (ax, ax2):
        a.axhline(target, color="gray", linewidth=0.8, linestyle="--", label=f"target {target}")
        a.set_ylabel("held-out AUC")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax.set_xlabel("training seconds (evaluations excluded)")
    ax.set_title("time to AUC, demo CTR model")
    ax2.set_xlabel("thousand examples trained")
    ax2.set_title("the same against examples")
    return procs.save_chart(fig, plt, path)


# -- Main --------------------------------------------------------------------------


def write_files(results_dir: str, name: str, lines: Sequence[str], header: dict,
                evals: Sequence[dict], summaries: Sequence[dict], target: float) -> str:
    """Writes <results_dir>/<name>.jsonl (the lines as printed), .md and .png; returns the stem."""
    os.makedirs(results_dir, exist_ok=True)
    stem = os.path.join(results_dir, name)
    with open(stem + ".jsonl", "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(header, evals, summaries))
    if evals:
        write_chart(evals, target, stem + ".png")
    sys.stderr.write(f"[time_to_auc] wrote {stem}.jsonl/.md/.png\n")
    return stem


def resummarize(path: str, milestones: Sequence[float], results_dir: str) -> int:
    """Recomputes an earlier run's summaries from its lines; rewrites its files.

    The evaluation lines and the run line are kept as they were; each new
    summary keeps what the run recorded beside the arithmetic (start-up,
    load, options).
    """
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    header = next(r for r in records if r["kind"] == "time_to_auc_run")
    evals = [r for r in records if r["kind"] == "time_to_auc_eval"]
    old = {(r["num_workers"], r["setup"]): r for r in records
           if r["kind"] == "time_to_auc_summary" and "error" not in r}
    failed = [r for r in records if r["kind"] == "time_to_auc_summary" and "error" in r]
    o = header["options"]
    summaries = [dict(old.get((s["num_workers"], s["setup"]), {}), **s)
                 for s in summarize(evals, o["target_auc"], o["max_seconds"],
                                    milestones=milestones)]
    lines = [json.dumps(r) for r in [header] + evals + summaries + failed]
    for line in lines[1 + len(evals):]:
        sys.stdout.write(line + "\n")
    write_files(results_dir or os.path.dirname(os.path.abspath(path)), header["name"], lines,
                header, evals, summaries + failed, o["target_auc"])
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.resummarize:
        return resummarize(args.resummarize, args.milestone_list, args.results_dir)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_time_to_auc_")
    os.makedirs(log_dir, exist_ok=True)
    from benchmarks import run as run_lib  # pylint: disable=g-import-not-at-top

    machine = dict(run_lib.machine_info(), log_dir=log_dir)
    lines: List[str] = []

    def emit(record: dict) -> None:
        lines.append(json.dumps(record))
        sys.stdout.write(lines[-1] + "\n")
        sys.stdout.flush()

    header = {"kind": "time_to_auc_run", "name": args.name, "argv": argv,
              "options": options(args), "machine": machine,
              "model": "keras_examples/ctr.py build_ctr_model (the demo's)",
              "rule": "per-worker batch the same in every setup; legacy Adagrad's rate "
                      + ("the same in every setup; " if args.lr_rule == "same" else
                         "x sqrt(W) for the hybrid setups, the base rate for stock PSS; ")
                      + "hybrid sync: one update per global step of W x per_worker_batch; "
                      "hybrid async: dense all-reduced, each worker pushes its own table "
                      "gradient; stock PSS: each worker applies its own batch asynchronously",
              "clock": "training only (each epoch's begin to end, tracing included); "
                       "evaluations excluded"}
    emit(header)
    evals: List[dict] = []
    failed: List[dict] = []
    info: Dict[tuple, dict] = {}  # (W, setup) -> what the chief and the box said
    runner = run_emulated if args.hosts == "emulated" else run_loopback
    for w in args.worker_list:
        for setup in args.setup_list:
            job = job_for(setup, w, args)
            sys.stderr.write(f"[time_to_auc] {setup} W={w} (load {os.getloadavg()[0]:.1f}) ...\n")
            base = {"kind": "time_to_auc_eval", "setup": setup, "num_workers": w}

            def on_eval(line, base=base):
                record = dict(base, **line)
                evals.append(record)
                emit(record)

            load_start = os.getloadavg()[0]
            cpu_start = cpu_snapshot()
            try:
                result = runner(job, args, log_dir, on_eval)
            except (procs.BenchmarkProcessError, RuntimeError) as e:
                failed.append({"kind": "time_to_auc_summary", "setup": setup, "num_workers": w,
                               "error": str(e)[-1500:], "reached": False})
                continue
            header.setdefault("tf_version", result.get("tf_version"))
            info[(w, setup)] = {"tf_version": result.get("tf_version"),"startup_seconds": round(result["startup_seconds"], 2),
                                "loadavg_start": round(load_start, 2),
                                "loadavg_end": round(os.getloadavg()[0], 2),
                                "other_cpu_share": round(other_cpu_share(
                                    cpu_start, cpu_snapshot(), machine["nproc"]), 3),
                                "chief_peak_rss_mb": round(result["peak_rss_mb"], 1),
                                "examples_per_step": result["examples_per_step"],
                                "steps_per_epoch": result["steps_per_epoch"]}
    summaries = (summarize(evals, args.target_auc, args.max_seconds,
                           milestones=args.milestone_list) if evals else [])
    for s in summaries:
        s.update(info.get((s["num_workers"], s["setup"]), {}))
        s["strategy_options"] = strategy_record(s["setup"],
                                                getattr(args, "dense_allreduce_dtype", None))
        s["per_worker_batch"] = args.per_worker_batch
        s["global_batch"] = args.per_worker_batch * s["num_workers"]
        s["learning_rate"] = learning_rate(s["setup"], s["num_workers"], args.learning_rate,
                                           args.lr_rule)
        s["lr_rule"] = args.lr_rule
        emit(s)
    for e in failed:
        emit(e)
    if args.results_dir:
        write_files(args.results_dir, args.name, lines, header, evals, list(summaries) + failed,
                    args.target_auc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
