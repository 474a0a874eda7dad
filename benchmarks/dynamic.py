"""`python -m benchmarks.run --dynamic`: a dynamic table against a static hashed one.

Why this module exists: a `tf_psplugin.layers.DynamicEmbedding` gives every
admitted raw key a row of its own, where a static table hashes raw keys into
a fixed number of rows and lets distinct keys collide. What that costs is
measured here, side by side in one invocation: the same 26-feature CTR model
(raw keys in a 2^40 id space, `benchmarks.model.raw_keys`), trained under
hybrid sync on the same data, with one table of `--capacity` rows either way:

* ``hashed``: static `Embedding`, row = hash(key) mod capacity;
* ``dynamic``: `DynamicEmbedding(capacity, admit_after, eviction="lru")`.

Per variant it reports examples/s and step time, CPU efficiency, peak RSS of
every task (PS RSS is where the tables live), held-out AUC and loss on
batches no step trained on, and the dynamic table's size and counts. The
summary line gives the step-time ratio dynamic / hashed against the target
(<= 1.3) and the AUC difference. ``--chart`` draws the three panels.
"""

import statistics
from typing import Dict, List

from benchmarks import procs

VARIANTS = ("hashed", "dynamic")
STEP_TIME_TARGET = 1.3


def jobs(args, variant: str, job_for, model_dict) -> dict:
    job = job_for("hybrid_sync", args, args.num_workers, model=model_dict(args, variant=variant))
    job["heldout_batches"] = args.heldout_batches
    return job


def records(runs: Dict[str, List[dict]], args) -> List[dict]:
    """One record per variant (medians over repeats) and a summary record."""
    out = []
    eps = {}
    for variant, results in runs.items():
        ok = [r for r in results if r.get("status") == "ok"]
        eps[variant] = statistics.median(r["examples_per_sec"] for r in ok) if ok else None
        last = ok[-1] if ok else results[-1]
        cpu = [r["examples_per_cpu_sec"] for r in ok if r.get("examples_per_cpu_sec")]
        rec = {
            "mode": "dynamic", "setup": variant, "status": "ok" if ok else "error",
            "examples_per_sec": round(eps[variant], 1) if eps[variant] else None,
            "step_ms": round(1000 * args.global_batch / eps[variant], 2) if eps[variant] else None,
            "examples_per_cpu_sec": round(statistics.median(cpu), 1) if cpu else None,
            "runs_examples_per_sec": [round(r["examples_per_sec"], 1) for r in ok],
            "peak_rss_mb": {k: round(v, 1) for k, v in last.get("peak_rss_mb", {}).items()},
            "heldout_auc": _median(ok, "heldout_auc"),
            "heldout_loss": _median(ok, "heldout_loss"),
            "capacity": args.capacity, "admit_after": args.admit_after,
            "global_batch": args.global_batch, "num_workers": args.num_workers,
            "num_ps": args.num_ps, "steps": last.get("timed_steps"),
            "tf_version": last.get("tf_version"),
        }
        if "table_size" in last:
            rec["table_size"] = last["table_size"]
            rec["table_stats"] = last.get("table_stats")
        if not ok:
            rec["error"] = last.get("error")
        out.append(rec)
    by = {r["setup"]: r for r in out}
    ratio = (round(eps["hashed"] / eps["dynamic"], 3)
             if eps.get("hashed") and eps.get("dynamic") else None)
    auc = [by[v]["heldout_auc"] for v in VARIANTS]
    ps_rss = {v: sum(x for k, x in by[v]["peak_rss_mb"].items() if k.startswith("ps"))
              for v in VARIANTS}
    out.append({
        "mode": "dynamic_summary",
        "step_time_ratio_dynamic_over_hashed": ratio,
        "target_step_time_ratio": STEP_TIME_TARGET,
        "target_met": ratio is not None and ratio <= STEP_TIME_TARGET,
        "heldout_auc_dynamic_minus_hashed": (round(auc[1] - auc[0], 4)
                                             if None not in auc else None),
        "ps_peak_rss_mb_total": {v: round(x, 1) for v, x in ps_rss.items()},
    })
    return out


def _median(results, key):
    values = [r[key] for r in results if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def table(recs: List[dict]) -> str:
    lines = [f"{'table':8s} {'examples/s':>10s} {'step ms':>8s} {'ex/cpu-s':>9s} "
             f"{'AUC':>7s} {'rows':>8s}  peak RSS MiB"]
    for r in recs:
        if r["mode"] != "dynamic":
            continue
        fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
        rss = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items())
        lines.append(f"{r['setup']:8s} {fmt(r['examples_per_sec'], '.0f'):>10s} "
                     f"{fmt(r['step_ms'], '.1f'):>8s} {fmt(r['examples_per_cpu_sec'], '.0f'):>9s} "
                     f"{fmt(r['heldout_auc'], '.4f'):>7s} "
                     f"{fmt(r.get('table_size', r['capacity']), 'd'):>8s}  {rss}")
    summary = recs[-1]
    lines.append(f"step time dynamic / hashed: {summary['step_time_ratio_dynamic_over_hashed']} "
                 f"(target <= {STEP_TIME_TARGET}); AUC dynamic - hashed: "
                 f"{summary['heldout_auc_dynamic_minus_hashed']}")
    return "\n".join(lines)


def chart(recs: List[dict], path: str, title: str = ""):
    """Three bar panels: examples/s, held-out AUC, PS peak RSS. None without matplotlib."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    rows = [r for r in recs if r["mode"] == "dynamic"]
    names = [r["setup"] for r in rows]
    panels = (
        ("examples/s", [r["examples_per_sec"] or 0 for r in rows], "{:.0f}"),
        ("held-out AUC", [r["heldout_auc"] or 0 for r in rows], "{:.4f}"),
        ("PS peak RSS, MiB (all PS)", [sum(v for k, v in r["peak_rss_mb"].items()
                                          if k.startswith("ps")) for r in rows], "{:.0f}"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    for ax, (label, values, fmt) in zip(axes, panels):
        bars = ax.bar(names, values, color=["tab:gray", "tab:orange"][:len(values)])
        for bar, v in zip(bars, values):
            ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=9)
        if label == "held-out AUC" and values and min(values) > 0:
            ax.set_ylim(min(values) - 0.05, max(values) + 0.02)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def mode_dynamic(args, log_dir: str, emit, job_for, model_dict, run_job, progress, show):
    runs: Dict[str, List[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            job = jobs(args, variant, job_for, model_dict)
            runs[variant].append(run_job(job, args, args.num_workers, log_dir))
            r = runs[variant][-1]
            progress(f"dynamic {variant}: {r.get('status')} "
                     f"{r.get('examples_per_sec') or 0:.0f} ex/s, AUC {r.get('heldout_auc')}")
    recs = records(runs, args)
    for r in recs:
        emit(r)
    show(table(recs))
    if args.chart:
        chart(recs, args.chart, title=f"capacity {args.capacity} rows, {args.global_batch} "
                                      f"examples per step, {args.num_workers} workers, "
                                      f"{args.num_ps} PS (hybrid sync)")
    return recs


__all__ = ["mode_dynamic", "records", "table", "chart", "procs"]
