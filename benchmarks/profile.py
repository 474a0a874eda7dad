"""Where a PS-cluster setup spends its time: TF profiler traces of every task.

Why this module exists: the throughput table says *how fast*; this says
*why*. It runs one setup on a loopback cluster and, once the warm-up epoch is
over, asks every worker and PS server for a TF profiler trace (their gRPC
servers host TensorFlow's profiler service) while the chief keeps training.
The XPlane traces are then summed per TraceMe/op name, per task, so the top
entries show what each process does per step (gathers, sparse applies,
collectives, send/recv, function dispatch). The raw traces stay in
`--profile_dir` for TensorBoard.

    python -m benchmarks.profile --setup hybrid_sync [--variant fused] \\
        [--steps_per_execution 8] [--trace_ms 4000] [--top 25]

Output: one JSON line per task with the top entries (stdout), a table (stderr).
"""

import argparse
import collections
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional

from benchmarks import procs, run


def summarize_xplane(path: str, top: int = 25) -> Dict[str, object]:
    """Sums event durations per event name in one ``*.xplane.pb`` file.

    Args:
        path: An XSpace file written by the profiler.
        top: How many names to keep, by total time.

    Returns:
        ``{"trace_seconds": wall span, "threads": n, "top": [[name, total_ms,
        count], ...]}`` over every CPU plane's lines.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top

    space = xplane_pb2.XSpace()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        space.ParseFromString(f.read())
    totals = collections.Counter()
    counts = collections.Counter()
    span_ps = 0
    threads = 0
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            threads += 1
            for ev in line.events:
                name = names.get(ev.metadata_id, "?")
                # "op_name:OpType" -> OpType: the same op in 26 tables is one row.
                key = name.rsplit(":", 1)[-1] if ":" in name and "::" not in name else name
                totals[key] += ev.duration_ps
                counts[key] += 1
                span_ps = max(span_ps, ev.offset_ps + ev.duration_ps)
    return {"trace_seconds": round(span_ps / 1e12, 3), "threads": threads,
            "top": [[k, round(v / 1e9, 2), counts[k]] for k, v in totals.most_common(top)]}


# perf symbol -> category, first match wins (CPU profile of a whole process).
CATEGORIES = (
    ("compute", r"Eigen|gemm|sgemm|contraction|mkl|dnnl|onednn|_mm|avx|Relu|BiasAdd|Adagrad|"
                r"Softplus|Sigmoid|Tanh|reduction|Reduce|Gather|Scatter|Unique|SegmentSum"),
    ("rpc_grpc_proto", r"grpc|protobuf|proto2|absl::.*Cord|Rendezvous|RecvTensor|"
                       r"tensorflow::eager::.*Service|EagerService|GrpcRemote|ToProtoField|"
                       r"FromProtoField|TensorProto|WorkerService"),
    ("collective", r"Collective|RingReducer|RingGatherer|HierarchicalTree|Permuter"),
    ("executor_runtime", r"Executor|OpKernel|ProcessFunctionLibraryRuntime|FunctionLibrary|"
                         r"KernelAndDevice|EagerOperation|EagerExecute|TensorHandle|"
                         r"ThreadPool|Eigen::ThreadPool|NodeDef|AttrValue|tsl::|tensorflow::"),
    ("memory", r"malloc|free|memcpy|memmove|memset|tcmalloc|_int_|cfree|operator new|"
               r"operator delete"),
    ("python", r"_PyEval|PyObject|_Py|Py[A-Z]"),
    ("kernel_os", r"\[k\]"),
)


def perf_record(pid: int, out: str, seconds: float) -> Optional[subprocess.Popen]:
    """Starts `perf record` of `pid` for `seconds` (None when perf is missing)."""
    import shutil  # pylint: disable=g-import-not-at-top

    if shutil.which("perf") is None:
        return None
    return subprocess.Popen(
        ["perf", "record", "-q", "-F", "299", "-p", str(pid), "-o", out, "--", "sleep",
         f"{seconds:.1f}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize_perf(path: str, top: int = 25) -> Dict[str, object]:
    """Flat CPU profile from a perf.data file: top symbols and categories (in % of samples)."""
    import re  # pylint: disable=g-import-not-at-top

    text = subprocess.run(
        ["perf", "report", "-i", path, "--stdio", "--no-children", "--sort", "dso,symbol",
         "--percent-limit", "0.05"], capture_output=True, text=True, timeout=300).stdout
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+(\[[.k]\])\s+(.*)", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3), m.group(4).strip()))
    cats = collections.Counter()
    for pct, dso, kind, sym in rows:
        label = "other"
        for name, pattern in CATEGORIES:
            if re.search(pattern, f"{kind} {sym} {dso}"):
                label = name
                break
        cats[label] += pct
    return {"perf_categories_pct": {k: round(v, 1) for k, v in cats.most_common()},
            "perf_top": [[round(p, 2), dso, sym[:120]] for p, dso, _, sym in rows[:top]]}


def _trace(address: str, logdir: str, duration_ms: int, errors: list) -> None:
    from tensorflow.python.profiler import profiler_client  # pylint: disable=g-import-not-at-top

    try:
        profiler_client.trace(f"grpc://{address}", logdir, duration_ms, num_tracing_attempts=1)
    except Exception as e:  # noqa: BLE001 - reported in the output, the run goes on.
        errors.append(f"{address}: {e!r}")


def profile_setup(args) -> List[dict]:
    """Runs the setup, traces every server during the timed epochs, summarises."""
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    opts = run.parse_args(["--setups", args.setup, "--steps_per_execution",
                           str(args.steps_per_execution), "--warmup_steps",
                           str(args.warmup_steps), "--steps", str(args.steps),
                           "--variant", args.variant, "--num_workers", str(args.num_workers)])
    job = run.job_for(args.setup, opts, args.num_workers)
    job["announce_epochs"] = True
    profile_dir = args.profile_dir or tempfile.mkdtemp(prefix="tf_psplugin_profile_")
    os.makedirs(profile_dir, exist_ok=True)
    log = os.path.join(profile_dir, f"{args.setup}.log")
    records = []
    with open(log, "w", encoding="utf-8") as out:
        with LocalCluster(num_workers=args.num_workers, num_ps=opts.num_ps, servers="builtin",
                          env=procs.child_env(), output=out, grace_period=2.0) as cluster:
            cluster.start_servers()
            if not cluster.wait_for_output("serving at", timeout=300,
                                           count=args.num_workers + opts.num_ps):
                raise procs.BenchmarkProcessError(f"servers did not start; log {log}")
            servers = {role: pid for role, pid in cluster.pids().items()}
            job["cpu_pids"] = servers
            result = {}
            chief = threading.Thread(
                target=lambda: result.update(done=cluster.run_chief(
                    procs.child_command(job), timeout=args.timeout)), daemon=True)
            chief.start()
            if not cluster.wait_for_output("BENCH_EPOCH_END 0", role="chief",
                                           timeout=args.timeout):
                raise procs.BenchmarkProcessError(f"warm-up did not finish; log {log}")
            errors: List[str] = []
            tracers = []
            perfs = {}
            if args.perf:
                for role, pid in servers.items():
                    out_path = os.path.join(profile_dir, f"perf-{role.replace(':', '-')}.data")
                    proc = perf_record(pid, out_path, args.trace_ms / 1000.0)
                    if proc is not None:
                        perfs[role] = (proc, out_path)
            for role in sorted(servers) if not args.no_xplane else []:
                job_name, index = role.split(":")
                address = cluster.config.cluster[job_name][int(index)]
                logdir = os.path.join(profile_dir, role.replace(":", "-"))
                t = threading.Thread(target=_trace, args=(address, logdir, args.trace_ms, errors))
                t.start()
                tracers.append((role, logdir, t))
            for _, _, t in tracers:
                t.join()
            for proc, _ in perfs.values():
                proc.wait(timeout=args.trace_ms / 1000.0 + 60)
            chief.join(timeout=args.timeout)
            done = result.get("done")
            bench = procs.parse_result(done.stdout, prefix="[chief] ") if done else {}
    for role, (_, path) in sorted(perfs.items()):
        rec = {"mode": "perf", "setup": args.setup, "variant": args.variant,
               "steps_per_execution": args.steps_per_execution, "role": role, "perf_data": path}
        rec.update(summarize_perf(path, args.top))
        records.append(rec)
    for role, logdir, _ in tracers:
        files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb*"), recursive=True))
        rec = {"mode": "profile", "setup": args.setup, "variant": args.variant,
               "steps_per_execution": args.steps_per_execution, "role": role,
               "trace_dir": logdir}
        if files:
            rec.update(summarize_xplane(files[-1], args.top))
        else:
            rec["error"] = "; ".join(e for e in errors if role in e) or "no trace written"
        records.append(rec)
    records.append({"mode": "profile_run", "setup": args.setup, "variant": args.variant,
                    "examples_per_sec": bench.get("examples_per_sec"),
                    "timed_cpu_seconds": bench.get("timed_cpu_seconds"),
                    "trace_errors": errors, "log": log})
    return records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("--setup", default="hybrid_sync",
                   choices=("stock_pss", "hybrid_sync", "hybrid_sync_unstacked", "hybrid_async"))
    p.add_argument("--variant", default="baseline",
                   choices=("baseline", "fused", "dedup", "fused_dedup", "multitable"))
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--steps_per_execution", type=int, default=8)
    p.add_argument("--warmup_steps", type=int, default=32)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--trace_ms", type=int, default=4000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--profile_dir", default=None)
    p.add_argument("--perf", action="store_true",
                   help="also sample every server's CPU with `perf record` (flat profile)")
    p.add_argument("--no_xplane", action="store_true", help="skip the TF profiler traces")
    p.add_argument("--plugin_path", default=None,
                   help="profile the tf_psplugin found in this directory (a patched copy)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plugin_path:
        os.environ[procs.PLUGIN_PATH_ENV] = os.path.abspath(args.plugin_path)
    for rec in profile_setup(args):
        sys.stdout.write(json.dumps(rec) + "\n")
        if rec["mode"] == "perf":
            sys.stderr.write(f"\n{rec['role']} perf categories (% CPU samples): "
                             f"{rec['perf_categories_pct']}\n")
            for pct, dso, sym in rec["perf_top"]:
                sys.stderr.write(f"  {pct:6.2f}% {dso[:28]:28s} {sym[:90]}\n")
        if rec["mode"] == "profile" and "top" in rec:
            sys.stderr.write(f"\n{rec['role']} ({rec['trace_seconds']} s traced, "
                             f"{rec['threads']} threads): total ms, count\n")
            for name, ms, n in rec["top"]:
                sys.stderr.write(f"  {name[:70]:70s} {ms:10.1f} {n:8d}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
