"""`python -m benchmarks.ablation`: one setup across a grid of knobs (and plugin copies).

Why this module exists: the profile points at candidate costs (Python dispatch
per execution, 26 lookups instead of one, duplicate ids, plugin internals);
an ablation measures each one by changing only that knob, interleaving the
configurations so that load from other processes on the box hits all of
them alike. Every run goes through the same child processes as
`benchmarks.run`, so the numbers are comparable with its table.

    python -m benchmarks.ablation --setup hybrid_sync \\
        --variants baseline,fused,dedup,fused_dedup --spe 8 --repeats 2
    python -m benchmarks.ablation --setup hybrid_sync --spe 1,8,32
    python -m benchmarks.ablation --setup hybrid_sync \\
        --plugin_paths /work/main,/tmp/patched   # A/B of a plugin patch
    python -m benchmarks.ablation --setup hybrid_sync \\
        --dense_bucket_bytes 0,262144 --repeats 2  # A/B of HybridOptions.dense_bucket_bytes

Output: one JSON line per configuration (medians over repeats), a table on
stderr. Use the ``examples_per_cpu_sec`` column when the box is loaded.
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile

from benchmarks import procs, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", default="hybrid_sync", choices=run.THROUGHPUT_SETUPS)
    p.add_argument("--variants", default="baseline")
    p.add_argument("--spe", default="8", help="steps_per_execution values")
    p.add_argument("--plugin_paths", default="",
                   help="comma-separated directories holding tf_psplugin copies (A/B)")
    p.add_argument("--dense_bucket_bytes", default="",
                   help="comma-separated HybridOptions.dense_bucket_bytes values (A/B; "
                        "default: the strategy's)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup_steps", type=int, default=32)
    p.add_argument("--pool_batches", type=int, default=16)
    p.add_argument("--log_dir", default=None)
    p.add_argument("--timeout", type=float, default=900.0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_ablation_")
    os.makedirs(log_dir, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    spes = [int(s) for s in args.spe.split(",") if s]
    paths = [p for p in args.plugin_paths.split(",") if p] or [""]
    buckets = [int(b) for b in args.dense_bucket_bytes.split(",") if b] or [None]
    grid = list(itertools.product(paths, variants, spes, buckets))
    results = {cfg: [] for cfg in grid}
    for _ in range(args.repeats):
        for cfg in grid:
            path, variant, spe, bucket = cfg
            warmup = max(args.warmup_steps, spe)
            warmup -= warmup % spe
            steps = max(args.steps - args.steps % warmup, warmup)
            opts = run.parse_args([
                "--setups", args.setup, "--variant", variant, "--steps_per_execution", str(spe),
                "--warmup_steps", str(warmup), "--steps", str(steps),
                "--pool_batches", str(min(args.pool_batches, warmup)),
                "--timeout", str(args.timeout)]
                + ([] if bucket is None else ["--dense_bucket_bytes", str(bucket)]))
            if path:
                os.environ[procs.PLUGIN_PATH_ENV] = os.path.abspath(path)
            else:
                os.environ.pop(procs.PLUGIN_PATH_ENV, None)
            sub_dir = os.path.join(log_dir, f"{os.path.basename(path) or 'repo'}-{variant}-{spe}"
                                   + ("" if bucket is None else f"-b{bucket}"))
            os.makedirs(sub_dir, exist_ok=True)
            job = run.job_for(args.setup, opts, opts.num_workers)
            r = run.run_job(job, opts, opts.num_workers, sub_dir)
            r["plugin"] = run.plugin_revision()
            r["strategy_options"] = (procs.strategy_options(job)
                                     if args.setup in run.HYBRID_SETUPS else None)
            results[cfg].append(r)
            sys.stderr.write(f"[ablation] {path or 'repo'} {variant} spe={spe} bucket={bucket}: "
                             f"{run._short(r)}\n")  # pylint: disable=protected-access
    lines = [f"{'plugin':24s} {'variant':12s} {'spe':>4s} {'bucket':>8s} {'examples/s':>11s} "
             f"{'ex/cpu-s':>9s}  cpu s per role (last run)"]
    for cfg, rs in results.items():
        path, variant, spe, bucket = cfg
        ok = [r for r in rs if r.get("status") == "ok"]
        eps = statistics.median(r["examples_per_sec"] for r in ok) if ok else None
        eff = [r["examples_per_cpu_sec"] for r in ok if r.get("examples_per_cpu_sec")]
        eff = statistics.median(eff) if eff else None
        rec = {"mode": "ablation", "setup": args.setup, "plugin": ok[-1]["plugin"] if ok else path,
               "variant": variant, "steps_per_execution": spe,
               "strategy_options": ok[-1].get("strategy_options") if ok else None,
               "examples_per_sec": round(eps, 1) if eps else None,
               "examples_per_cpu_sec": round(eff, 1) if eff else None,
               "runs_examples_per_sec": [round(r["examples_per_sec"], 1) for r in ok],
               "timed_cpu_seconds": ok[-1].get("timed_cpu_seconds") if ok else None,
               "loadavg_start": [r.get("loadavg_start") for r in rs],
               "status": "ok" if ok else "error"}
        if not ok:
            rec["error"] = rs[-1].get("error")
        sys.stdout.write(json.dumps(rec) + "\n")
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in (rec["timed_cpu_seconds"] or {}).items())
        lines.append(f"{(os.path.basename(path) or 'repo')[:24]:24s} {variant:12s} {spe:4d} "
                     f"{'-' if bucket is None else bucket:>8} "
                     f"{(f'{eps:.0f}' if eps else 'error'):>11s} "
                     f"{(f'{eff:.0f}' if eff else '-'):>9s}  {cpu}")
    sys.stderr.write("\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
