"""`python -m benchmarks.soak`: long-running jobs, watched for leaks and slow-down.

Why this module exists: `benchmarks.run` times a few hundred steps; a job that
leaks a thread, a file descriptor or a few KiB per step passes that and dies
hours later (issue 12). This trains the benchmark model under each setup for
a wall-clock duration and samples every task from `/proc` while it runs:

    python -m benchmarks.soak                    # 20 min per setup
    python -m benchmarks.soak --quick            # 3 min per setup
    python -m benchmarks.soak --minutes 60 --setups hybrid_sync,stock_pss \\
        --output soak.jsonl --chart benchmarks/results/soak.png

Each setup starts chief + workers + PS on loopback with
`tf_psplugin.launch.LocalCluster`, exactly as `benchmarks.run` does for the
same setup (same job: `run.job_for`, same model, global batch 1024,
steps_per_execution 8), but the chief (``benchmarks.child``, role
``soak_chief``) runs `model.fit` in epochs of ``--steps_per_epoch`` steps
until ``--minutes`` of training have passed, printing a ``SOAK_PROGRESS``
line after every epoch. Every ``--interval`` seconds this process prints one
``soak_sample`` JSON line (threads, RSS, open fds of every task; examples/s
between the chief's two latest progress lines), and after each setup one
``soak_summary`` line (see `benchmarks.soak_stats` for the definitions). A
task that dies stops its setup (``"completed": false``); the next setup
still runs, and the exit status is 1. After all setups the chart is written.

JSON lines go to stdout (and ``--output``), progress to stderr.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import procs, run
from benchmarks import soak_stats as stats

SETUPS = ("hybrid_sync", "stock_pss", "hybrid_async", "hybrid_sync_unstacked")
DEFAULT_SETUPS = ("hybrid_sync", "stock_pss")
DEFAULT_MINUTES = 20.0
QUICK_MINUTES = 3.0
DEFAULT_CHART = os.path.join(procs.REPO_ROOT, "benchmarks", "results", "soak.png")
STARTUP_SECONDS = 600.0  # Chief start (TF import, strategy, model) to first progress line.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description="Long runs sampled for thread/fd/RSS growth and throughput decay: "
                    "JSON lines on stdout, progress on stderr.")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=None,
                        help=f"training minutes per setup (default {DEFAULT_MINUTES:g})")
    length.add_argument("--quick", action="store_true",
                        help=f"{QUICK_MINUTES:g} minutes per setup")
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS),
                   help=f"comma-separated, run one after another; of {','.join(SETUPS)}")
    p.add_argument("--interval", type=float, default=5.0, help="sampling period, seconds")
    p.add_argument("--warmup_minutes", type=float, default=None,
                   help="excluded from the growth figures, from the start of training "
                        "(default min(5, minutes/6))")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--chart", default=DEFAULT_CHART,
                   help="PNG written after all setups ('' for none)")
    p.add_argument("--steps_per_epoch", type=int, default=128,
                   help="steps between progress lines (~5-10 s of work here)")
    p.add_argument("--global_batch", type=int, default=1024)
    p.add_argument("--steps_per_execution", type=int, default=8)
    p.add_argument("--pool_batches", type=int, default=32,
                   help="distinct cached batches per reader (as benchmarks.run)")
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--num_ps", type=int, default=2)
    p.add_argument("--variant", default="baseline",
                   help="model variant (benchmarks/model.py); 'dynamic': a DynamicEmbedding "
                        "of --capacity rows on raw keys")
    p.add_argument("--capacity", type=int, default=None,
                   help="rows of the raw-key variants' table (default: benchmarks.run's); "
                        "65536 is below the pool's distinct keys: admission and eviction "
                        "in every step")
    p.add_argument("--stall_seconds", type=float, default=300.0,
                   help="stop the setup (not completed) if no epoch ends for this long")
    p.add_argument("--epoch_pass", action="store_true",
                   help="hybrid setups: each epoch is one pass over a finite dataset "
                        "(--steps_per_epoch = --pool_batches), so every epoch makes new "
                        "per-worker iterators (watches iterator and dataset release)")
    p.add_argument("--dense_allreduce_dtype", choices=("none", "bfloat16", "float16"),
                   default="none",
                   help="the hybrid setups' HybridOptions.dense_allreduce_dtype (as "
                        "benchmarks.run; none: the default, the gradients' own dtype)")
    p.add_argument("--log_dir", default=None, help="cluster logs (default: a temp dir)")
    p.add_argument("--checkpoint_every_secs", type=float, default=120.0,
                   help="hybrid setups: ChiefCheckpoint every this many seconds, keep 3, in "
                        "a model_dir under the log dir, sampled like a task (0: none)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and completes the arguments; bad values exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes = QUICK_MINUTES
    elif args.minutes is None:
        args.minutes = DEFAULT_MINUTES
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    if args.checkpoint_every_secs < 0:
        parser.error("--checkpoint_every_secs must be >= 0")
    if args.warmup_minutes is None:
        args.warmup_minutes = min(5.0, args.minutes / 6.0)
    if not 0 <= args.warmup_minutes < args.minutes:
        parser.error("--warmup_minutes must be >= 0 and < --minutes")
    setups = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown or not setups:
        parser.error(f"unknown setups {unknown}; choose from {','.join(SETUPS)}")
    args.setup_list = setups
    spe = args.steps_per_execution
    if spe < 1 or args.steps_per_epoch < 1 or args.steps_per_epoch % spe:
        parser.error("--steps_per_epoch must be a multiple of --steps_per_execution")
    if not 1 <= args.pool_batches <= args.steps_per_epoch:
        parser.error("--pool_batches must be in [1, --steps_per_epoch]")
    if args.epoch_pass and args.pool_batches != args.steps_per_epoch:
        parser.error("--epoch_pass needs --pool_batches equal to --steps_per_epoch")
    if args.num_workers < 1 or args.num_ps < 1 or args.global_batch % args.num_workers:
        parser.error("need >= 1 worker and PS, and --global_batch divisible by --num_workers")
    return args


def chief_job(setup: str, args: argparse.Namespace) -> dict:
    """The chief's job: `benchmarks.run`'s job for `setup`, trained for a duration."""
    opts = run.parse_args([
        "--setups", setup, "--global_batch", str(args.global_batch),
        "--steps_per_execution", str(args.steps_per_execution),
        "--warmup_steps", str(args.steps_per_epoch), "--steps", str(args.steps_per_epoch),
        "--pool_batches", str(args.pool_batches), "--num_workers", str(args.num_workers),
        "--num_ps", str(args.num_ps), "--variant", args.variant,
        "--dense_allreduce_dtype", args.dense_allreduce_dtype]
        + ([] if args.capacity is None else ["--capacity", str(args.capacity)]))
    job = run.job_for(setup, opts, args.num_workers)
    job.update(role="soak_chief", duration_seconds=args.minutes * 60.0,
               checkpoint_every_secs=args.checkpoint_every_secs, epoch_pass=args.epoch_pass)
    return job


def read_dir(path: Optional[str]) -> Optional[Dict[str, float]]:
    """Files and MiB under a directory (the model_dir); None if absent."""
    if not path or not os.path.isdir(path):
        return None
    files, size = 0, 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.path.getsize(os.path.join(root, name))
                files += 1
            except OSError:
                pass  # Deleted by retention while we walked.
    return {"files": files, "mb": round(size / 2**20, 1)}


def read_task(pid: int) -> Optional[Dict[str, float]]:
    """Threads, RSS (MiB) and open fds of a live process; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if fields.get("State", "").strip().startswith(("Z", "X")) or "VmRSS" not in fields:
        return None
    return {"threads": int(fields["Threads"]),
            "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024.0, 1), "fds": fds}


def parse_progress(lines: Sequence[str], t0: float) -> List[dict]:
    """The chief's ``SOAK_PROGRESS`` lines, with ``t_s`` on this process's axis (t0 = 0)."""
    marker = "[chief] " + procs.SOAK_PROGRESS_PREFIX
    points = []
    for line in lines:
        if line.startswith(marker):
            try:
                rec = json.loads(line[len(marker):])
            except ValueError:
                continue
            points.append({"t_s": rec["mono"] - t0, "steps": rec["steps"],
                           "examples": rec["examples"]})
    return points


def take_sample(setup: str, pids: Dict[str, int], chief_lines: Sequence[str], t0: float,
                model_dir: Optional[str] = None) -> dict:
    """One ``soak_sample``: every live task from /proc plus the chief's latest progress."""
    now = time.monotonic()
    tasks = {}
    for role, pid in sorted(pids.items()):
        values = read_task(pid)
        if values is not None:
            tasks[role] = values
    points = parse_progress(chief_lines, t0)
    last = points[-1] if points else None
    rate = stats.rate_of_latest([(p["t_s"], p["examples"]) for p in points])
    return {"kind": "soak_sample", "setup": setup, "t_s": round(now - t0, 2),
            "train_start_s": round(points[0]["t_s"], 3) if points else None,
            "first_epoch_end_s": next((round(p["t_s"], 3) for p in points if p["steps"] > 0),
                                      None),
            "steps": last["steps"] if last else 0, "examples": last["examples"] if last else 0,
            "progress_t_s": round(last["t_s"], 3) if last else None,
            "examples_per_sec": round(rate, 1) if rate is not None else None, "tasks": tasks,
            "model_dir": read_dir(model_dir)}


def _exit_code(cluster, role: str) -> Optional[int]:
    """The exit code the launcher logged for `role` (``[launch] worker:0 exited (exit N)``)."""
    for line in reversed(cluster.output("launch")):
        if f"] {role} exited (exit " in line:
            try:
                return int(line.split("(exit ", 1)[1].split(")")[0])
            except ValueError:
                return None
    return None


def _progress(msg: str) -> None:
    sys.stderr.write(f"[soak] {msg}\n")
    sys.stderr.flush()


def _describe(sample: dict, minutes: float) -> str:
    per_role = {}
    for task, v in sample["tasks"].items():
        per_role.setdefault(stats.role_of(task), []).append(v)
    roles = "; ".join(
        "{} threads {} RSS {}".format(r, "/".join(str(v["threads"]) for v in vs),
                                      "/".join(str(round(v["rss_mb"])) for v in vs))
        for r, vs in per_role.items())
    eps = sample["examples_per_sec"]
    eps_text = "-" if eps is None else str(round(eps))
    return (f"{sample['setup']} {sample['t_s'] / 60:.1f} min (training {minutes:g} min): "
            f"{eps_text} examples/s, step {sample['steps']}; {roles}")


def run_setup(setup: str, args: argparse.Namespace, log_dir: str, emit,
              attempts: int = 3) -> Tuple[List[dict], dict]:
    """Runs one setup for ``args.minutes``, emitting samples; returns them and the summary.

    A server that cannot bind its port restarts the cluster on fresh ports, at
    most `attempts` times.
    """
    for attempt in range(1, attempts + 1):
        try:
            samples, deaths, failure = _run_setup_once(setup, args, log_dir, emit)
            break
        except procs.PortClash:
            if attempt == attempts:
                samples, deaths = [], []
                failure = f"servers could not bind their ports {attempts} times"
        except procs.BenchmarkProcessError as e:
            samples, deaths, failure = [], [], str(e)[-2000:]
            break
    summary = stats.summarize(samples, setup, args.warmup_minutes * 60.0,
                              minutes_requested=args.minutes, task_deaths=deaths,
                              failure=failure)
    # What the strategy ran with (None for stock PSS, which takes no HybridOptions).
    summary["strategy_options"] = (procs.strategy_options(chief_job(setup, args))
                                   if setup in run.HYBRID_SETUPS else None)
    return samples, summary


def _run_setup_once(setup, args, log_dir, emit):
    """One cluster for `setup`: sample until the chief exits or something fails.

    Returns:
        ``(samples, task_deaths, failure)``; failure is None if the chief
        trained for the whole duration and exited 0 with its result line.

    Raises:
        procs.PortClash: a server could not bind its port (retry).
        procs.BenchmarkProcessError: the servers did not start.
    """
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    log = os.path.join(log_dir, f"soak-{setup}.log")
    job = chief_job(setup, args)
    job["model_dir"] = os.path.join(log_dir, f"model-{setup}")
    samples: List[dict] = []
    deaths: List[dict] = []
    failure = None
    chief: Dict[str, object] = {}
    finished = threading.Event()
    with open(log, "w", encoding="utf-8") as out:
        with LocalCluster(num_workers=args.num_workers, num_ps=args.num_ps, servers="builtin",
                          env=procs.child_env(), output=out, grace_period=2.0) as cluster:
            # The `with` stops (SIGTERM, then SIGKILL) every task, also on errors
            # and Ctrl-C; the chief's thread then returns.
            cluster.start_servers()
            procs.wait_until_serving(cluster, args.num_workers + args.num_ps, log)
            t0 = time.monotonic()

            def run_chief():
                try:
                    chief["done"] = cluster.run_chief(procs.child_command(job))
                except Exception as e:  # pylint: disable=broad-except
                    chief["error"] = repr(e)  # Reported as the setup's failure below.
                finally:
                    chief["t_s"] = time.monotonic() - t0
                    finished.set()

            thread = threading.Thread(target=run_chief, name="soak-chief", daemon=True)
            thread.start()
            next_sample, next_report = t0, t0
            training_deadline = t0 + STARTUP_SECONDS + args.minutes * 60.0 + args.stall_seconds
            while not finished.is_set():
                pids = cluster.pids()
                sample = take_sample(setup, pids, cluster.output("chief"), t0, job["model_dir"])
                if finished.is_set() or ("chief" in pids and "chief" not in sample["tasks"]
                                         and finished.wait(5.0)):
                    break  # The chief ended while we sampled: not a death.
                for role, pid in pids.items():
                    if role not in sample["tasks"]:
                        time.sleep(0.5)  # Let the launcher log the exit code.
                        deaths.append({"role": role, "pid": pid, "t_s": sample["t_s"],
                                       "exit_code": _exit_code(cluster, role)})
                samples.append(sample)
                emit(sample)
                now = time.monotonic()
                if deaths:
                    failure = "task died: " + ", ".join(d["role"] for d in deaths)
                elif sample["progress_t_s"] is None and now - t0 > STARTUP_SECONDS:
                    failure = f"training did not start within {STARTUP_SECONDS:.0f} s"
                elif (sample["progress_t_s"] is not None
                      and sample["t_s"] - sample["progress_t_s"] > args.stall_seconds):
                    failure = f"stalled: no epoch ended in {args.stall_seconds:.0f} s"
                elif now > training_deadline:
                    failure = "timed out"
                if failure:
                    _progress(f"{setup}: {failure}; stopping this setup")
                    break
                if now >= next_report:
                    _progress(_describe(sample, args.minutes))
                    next_report = now + 60.0
                next_sample += args.interval
                finished.wait(max(0.0, next_sample - time.monotonic()))
        thread.join(timeout=60)
    shutil.rmtree(job["model_dir"], ignore_errors=True)  # Checkpoints: ~1 GB, not needed.
    if failure is None:
        failure = _chief_failure(chief, log, deaths)
    return samples, deaths, failure


def _chief_failure(chief: dict, log: str, deaths: List[dict]) -> Optional[str]:
    """Why the chief's run does not count as completed (None if it does)."""
    done = chief.get("done")
    if done is None:
        return f"chief did not run: {chief.get('error', 'unknown')}; log {log}"
    if done.returncode != 0:
        deaths.append({"role": "chief", "pid": None, "t_s": round(chief["t_s"], 2),
                       "exit_code": done.returncode})
        tail = "\n".join(done.stdout.splitlines()[-25:])
        return f"chief exited {done.returncode}; log {log}:\n{tail}"
    try:
        procs.parse_result(done.stdout, prefix="[chief] ")
    except procs.BenchmarkProcessError as e:
        return f"chief printed no result: {e}"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_soak_")
    os.makedirs(log_dir, exist_ok=True)
    out_file = open(args.output, "a", encoding="utf-8") if args.output else None  # noqa: SIM115
    machine = run.machine_info()
    machine["log_dir"] = log_dir
    knobs = {"global_batch": args.global_batch, "steps_per_execution": args.steps_per_execution,
             "steps_per_epoch": args.steps_per_epoch, "pool_batches": args.pool_batches,
             "num_workers": args.num_workers, "num_ps": args.num_ps,
             "interval_s": args.interval, "optimizer": "legacy.Adagrad(0.05)",
             "model": ("benchmarks/model.py baseline (26 tables of 100k x 16)"
                       if args.variant == "baseline" else
                       f"benchmarks/model.py {args.variant} (one table of "
                       f"{args.capacity or 'the default'} rows)")}

    def emit(record: dict) -> None:
        line = json.dumps(record)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        if out_file:
            out_file.write(line + "\n")
            out_file.flush()

    all_samples: List[dict] = []
    summaries: List[dict] = []
    try:
        for setup in args.setup_list:
            _progress(f"{setup}: {args.minutes:g} min of training, warm-up "
                      f"{args.warmup_minutes:g} min, sampling every {args.interval:g} s; "
                      f"logs in {log_dir}")
            samples, summary = run_setup(setup, args, log_dir, emit)
            summary.update(knobs=knobs, machine=machine)
            emit(summary)
            sys.stderr.write("\n" + stats.format_summary(summary) + "\n\n")
            all_samples += samples
            summaries.append(summary)
    finally:
        if out_file:
            out_file.close()
    if args.chart and all_samples:
        try:
            stats.write_chart(all_samples, args.chart,
                              {s: args.warmup_minutes * 60.0 for s in args.setup_list})
            _progress(f"chart: {args.chart}")
        except ImportError:
            _progress("error: matplotlib is not installed, chart skipped; "
                      "install it with: pip install -e .[bench]")
    return 0 if all(s["completed"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
