"""Where a PS-cluster setup spends its time: TF profiler traces of every task.

Why this module exists: the throughput table says *how fast*; this says
*why*. It runs one setup on a loopback cluster and, after the warm-up epoch,
measures ``--clean_epochs`` untraced epochs (CPU-seconds per 1000 examples
per role from /proc, TCP bytes per step between every pair of tasks from
`ss` listings the chief takes at two epoch ends, i.e. over whole steps).
Then it asks every worker and PS server for a TF profiler trace (their gRPC
servers host TensorFlow's profiler service) while the chief keeps training,
and the chief traces one epoch of its own. Each trace is summed per
TraceMe/op name (whole durations, and self times: a parent's duration
minus its children's, see `profile_stats`), grouped into categories
(collective, send/recv, embedding, dense compute, ...; "blocked" for
threads that only wait for a function's ops or a remote result) and divided
by the steps the trace holds. The raw traces stay in `--profile_dir` for
TensorBoard.

    python -m benchmarks.profile --setup hybrid_sync [--variant fused] \\
        [--steps_per_execution 8] [--trace_ms 4000] [--top 25] [--perf] \\
        [--output FILE.jsonl] [--chart FILE.png]
    python -m benchmarks.profile --chart_from A.jsonl,B.jsonl --chart AB.png

Output: one JSON line per task (``mode: "profile"``; ``"perf"`` with
``--perf``) and one for the run (``"profile_run"``) on stdout, a summary on
stderr. A "step" is one global batch (1024 examples) in every setup.
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

from benchmarks import procs, profile_stats, run


def read_xplane_lines(path: str):
    """Every CPU-plane line of one ``*.xplane.pb`` file as ``(offset_ps, duration_ps, name)`` lists."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top

    space = xplane_pb2.XSpace()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        space.ParseFromString(f.read())
    lines = []
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            lines.append([(ev.offset_ps, ev.duration_ps, names.get(ev.metadata_id, "?"))
                          for ev in line.events])
    return lines


def summarize_xplane(path: str, top: int = 25) -> Dict[str, object]:
    """Sums event durations per event name in one ``*.xplane.pb`` file.

    Args:
        path: An XSpace file written by the profiler.
        top: How many names to keep, by total time.

    Returns:
        ``{"trace_seconds": wall span, "threads": n, "top": [[name, total_ms,
        count], ...], "ops": {name: [self_ms, count]}}`` over every CPU
        plane's lines; ``top`` sums whole durations (nested events count in
        their parents too), ``ops`` self times (`profile_stats.self_times`).
    """
    lines = read_xplane_lines(path)
    totals = collections.Counter()
    counts = collections.Counter()
    span_ps = 0
    for events in lines:
        for offset, duration, name in events:
            # "op_name:OpType" -> OpType: the same op in 26 tables is one row.
            key = profile_stats.op_key(name)
            totals[key] += duration
            counts[key] += 1
            span_ps = max(span_ps, offset + duration)
    ops = {k: [round(v[0] / 1e9, 3), int(v[1])]
           for k, v in profile_stats.aggregate(lines).items()}
    return {"trace_seconds": round(span_ps / 1e12, 3), "threads": len(lines),
            "top": [[k, round(v / 1e9, 2), counts[k]] for k, v in totals.most_common(top)],
            "ops": ops}


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
    """Runs the setup, measures its clean epochs, then traces every task; summarises.

    Epochs: 0 is the warm-up; 1..``clean_epochs`` run untraced (CPU seconds
    per role and TCP bytes per pair of tasks between the ends of epochs 0
    and ``clean_epochs``: whole steps, since Keras joins every step at an
    epoch end); then every worker and PS is traced for ``trace_ms`` and the
    chief for epoch ``clean_epochs + 1`` (its own trace, in-process).
    """
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    opts = run.parse_args(["--setups", args.setup, "--steps_per_execution",
                           str(args.steps_per_execution), "--warmup_steps",
                           str(args.warmup_steps), "--steps", str(args.steps),
                           "--variant", args.variant, "--num_workers", str(args.num_workers)])
    if args.steps // args.warmup_steps < args.clean_epochs + 2:
        raise SystemExit(f"--steps {args.steps} leaves no epoch to trace after "
                         f"--clean_epochs {args.clean_epochs}: give --steps >= "
                         f"{(args.clean_epochs + 2) * args.warmup_steps}")
    args.global_batch = opts.global_batch  # A step: this many examples, in every setup.
    job = run.job_for(args.setup, opts, args.num_workers)
    job["announce_epochs"] = True
    profile_dir = args.profile_dir or tempfile.mkdtemp(prefix="tf_psplugin_profile_")
    os.makedirs(profile_dir, exist_ok=True)
    chief_dir = os.path.join(profile_dir, "chief")
    job["profile"] = {"trace_dir": chief_dir, "trace_epoch": args.clean_epochs + 1,
                      "ss_epochs": [0, args.clean_epochs]}
    log = os.path.join(profile_dir, f"{args.setup}.log")
    records = []
    load = [round(x, 2) for x in os.getloadavg()]
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
            if not cluster.wait_for_output(f"BENCH_EPOCH_END {args.clean_epochs}",
                                           role="chief", timeout=args.timeout):
                raise procs.BenchmarkProcessError(f"clean epochs did not finish; log {log}")
            pid_roles = {pid: role for role, pid in cluster.pids().items()}
            errors: List[str] = []
            tracers = []
            perfs = {}
            if args.perf:
                for role, pid in cluster.pids().items():  # The chief's too.
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
    if not args.no_xplane:
        tracers.append(("chief", chief_dir, None))
    for role, logdir, _ in tracers:
        files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb*"), recursive=True))
        rec = {"mode": "profile", "setup": args.setup, "variant": args.variant,
               "steps_per_execution": args.steps_per_execution, "role": role,
               "trace_dir": logdir}
        if files:
            rec.update(summarize_xplane(files[-1], args.top))
            rec.update(step_figures(rec, args.setup, role, args))
        else:
            rec["error"] = "; ".join(e for e in errors if role in e) or "no trace written"
        records.append(rec)
    records.append(clean_epochs_record(bench, args, pid_roles, load, log, errors))
    return records


def steps_in_trace(rec: dict, setup: str, role: str, args) -> Optional[float]:
    """Global steps (of ``global_batch`` examples) that a task's trace holds.

    The chief traces exactly one epoch. A worker or PS trace is cut by time;
    its steps are counted from the step function's executions (one per
    ``steps_per_execution`` steps of a worker), see `profile_stats.STEP_MARKERS`.
    """
    if role == "chief":
        return float(args.warmup_steps)
    return profile_stats.steps_from_markers(rec["ops"], setup, role, args.num_workers,
                                            args.steps_per_execution)


def step_figures(rec: dict, setup: str, role: str, args) -> dict:
    """Per-step self time per category and op, RPC counts per step, category shares."""
    cats = profile_stats.by_category(rec["ops"], role.split(":")[0])
    out = {"category_ms": {k: round(v, 2) for k, v in cats.items()},
           "category_share": {k: round(v, 4) for k, v in profile_stats.shares(cats).items()},
           "rpcs": profile_stats.rpc_counts(rec["ops"])}
    steps = steps_in_trace(rec, setup, role, args)
    out["steps_in_trace"] = steps
    if steps:
        out["category_ms_per_step"] = profile_stats.per_unit(cats, steps)
        out["rpcs_per_step"] = profile_stats.per_unit(out["rpcs"], steps, 2)
        out["ops_run_per_step"] = round(profile_stats.ops_run(rec["ops"]) / steps, 1)
        out["ops_per_step"] = {k: [round(ms / steps, 3), round(n / steps, 2)]
                               for k, (ms, n) in rec["ops"].items() if n / steps >= 0.5}
    return out


def clean_epochs_record(bench: dict, args, pid_roles: Dict[int, str], load, log: str,
                        errors: List[str]) -> dict:
    """CPU-seconds per 1000 examples per role and bytes per step, over the clean epochs."""
    rec = {"mode": "profile_run", "setup": args.setup, "variant": args.variant,
           "num_workers": args.num_workers, "global_batch": args.global_batch,
           "steps_per_execution": args.steps_per_execution,
           "examples_per_sec": bench.get("examples_per_sec"), "loadavg_start": load,
           "loadavg_end": bench.get("loadavg_end"), "tf_version": bench.get("tf_version"),
           "plugin": run.plugin_revision(), "trace_errors": errors, "log": log}
    marks = bench.get("epoch_cpu_marks") or []
    n = args.clean_epochs
    if len(marks) > n + 1:
        steps = n * args.warmup_steps
        examples = steps * args.global_batch
        cpu = profile_stats.cpu_between_epochs(marks, 0, n)
        rec["clean_steps"] = steps
        rec["clean_examples_per_sec"] = [round(x, 1) for x in
                                         bench.get("epoch_examples_per_sec", [])[:n]]
        rec["cpu_seconds_per_1000_examples"] = profile_stats.per_unit(cpu, examples / 1000.0, 4)
        rec["examples_per_cpu_sec"] = round(examples / sum(cpu.values()), 1)
    ss = bench.get("ss") or {}
    if "0" in ss and str(n) in ss:
        by_peer = profile_stats.bytes_by_peer(profile_stats.parse_ss(ss["0"]),
                                              profile_stats.parse_ss(ss[str(n)]), pid_roles)
        steps = n * args.warmup_steps
        rec["bytes_per_step"] = {
            role: {peer: {k: round(v / steps) for k, v in d.items()}
                   for peer, d in sorted(peers.items())}
            for role, peers in sorted(by_peer.items())}
        rec["bytes_per_step_total"] = {
            role: {k: sum(d[k] for d in peers.values()) for k in ("sent", "received")}
            for role, peers in rec["bytes_per_step"].items()}
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("--setup", default="hybrid_sync",
                   choices=("stock_pss", "hybrid_sync", "hybrid_sync_unstacked", "hybrid_async"))
    p.add_argument("--variant", default="baseline",
                   choices=("baseline", "fused", "dedup", "fused_dedup", "multitable"))
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--steps_per_execution", type=int, default=8)
    p.add_argument("--warmup_steps", type=int, default=32)
    p.add_argument("--steps", type=int, default=384,
                   help="timed steps: --clean_epochs untraced epochs, then the traces")
    p.add_argument("--clean_epochs", type=int, default=4,
                   help="untraced epochs after the warm-up: CPU per role, bytes per step")
    p.add_argument("--trace_ms", type=int, default=4000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--profile_dir", default=None)
    p.add_argument("--perf", action="store_true",
                   help="also sample every server's CPU with `perf record` (flat profile)")
    p.add_argument("--no_xplane", action="store_true", help="skip the TF profiler traces")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--chart", default=None,
                   help="PNG: stacked bars of each task's time per category")
    p.add_argument("--recompute", default=None,
                   help="comma-separated results files: recompute their per-step figures "
                        "from the stored per-name sums (no run)")
    p.add_argument("--chart_from", default=None,
                   help="comma-separated JSON-lines files of earlier runs: only draw --chart")
    p.add_argument("--plugin_path", default=None,
                   help="profile the tf_psplugin found in this directory (a patched copy)")
    return p


def _print_summary(rec: dict) -> None:
    if rec["mode"] == "perf":
        sys.stderr.write(f"\n{rec['role']} perf categories (% CPU samples): "
                         f"{rec['perf_categories_pct']}\n")
        for pct, dso, sym in rec["perf_top"]:
            sys.stderr.write(f"  {pct:6.2f}% {dso[:28]:28s} {sym[:90]}\n")
    if rec["mode"] == "profile" and "top" in rec:
        sys.stderr.write(f"\n{rec['role']} ({rec['trace_seconds']} s traced, "
                         f"{rec['threads']} threads, {rec.get('steps_in_trace')} steps): "
                         f"total ms, count\n")
        for name, ms, n in rec["top"]:
            sys.stderr.write(f"  {name[:70]:70s} {ms:10.1f} {n:8d}\n")
        sys.stderr.write(f"  self ms per step by category: {rec.get('category_ms_per_step')}\n"
                         f"  share: {rec.get('category_share')}\n"
                         f"  RPCs per step: {rec.get('rpcs_per_step')}\n")
    if rec["mode"] == "profile_run":
        sys.stderr.write(f"\n{rec['setup']}: CPU s per 1000 examples "
                         f"{rec.get('cpu_seconds_per_1000_examples')}; examples per CPU-s "
                         f"{rec.get('examples_per_cpu_sec')}\n  bytes per step "
                         f"{rec.get('bytes_per_step')}\n")


def recompute(path: str, args) -> List[dict]:
    """Recomputes the per-step figures of a results file's task lines from their ``ops``.

    For a file written by an earlier version of this module (categories,
    step markers): the traces' per-name sums are stored in each line, so
    nothing is traced again. Writes the file back; returns its lines.
    """
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    for rec in records:
        if rec.get("mode") == "profile" and "ops" in rec:
            run_args = argparse.Namespace(
                warmup_steps=args.warmup_steps, num_workers=args.num_workers,
                steps_per_execution=rec.get("steps_per_execution", args.steps_per_execution))
            for key in ("category_ms_per_step", "rpcs_per_step", "ops_per_step",
                        "ops_run_per_step"):
                rec.pop(key, None)
            rec.update(step_figures(rec, rec["setup"], rec["role"], run_args))
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return records


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.recompute:
        for path in args.recompute.split(","):
            for rec in recompute(path, args):
                _print_summary(rec)
        return 0
    if args.chart_from:
        records = []
        for path in args.chart_from.split(","):
            with open(path, encoding="utf-8") as f:
                records.extend(json.loads(line) for line in f if line.strip())
        if not args.chart:
            raise SystemExit("--chart_from needs --chart PNG (where the chart goes)")
        written = profile_stats.stacked_bars(records, args.chart)
        sys.stderr.write(f"chart: {written or 'not written (no matplotlib)'}\n")
        return 0
    if args.plugin_path:
        os.environ[procs.PLUGIN_PATH_ENV] = os.path.abspath(args.plugin_path)
    emit = procs.json_lines_emitter(args.output)
    records = profile_setup(args)
    for rec in records:
        emit(rec)
        _print_summary(rec)
    if args.chart:
        profile_stats.stacked_bars(records, args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
