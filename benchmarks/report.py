"""`python -m benchmarks.report FILE.jsonl ... [--chart X.png]`: tables (and a chart) from JSON lines.

Why this module exists: benchmarks/README.md carries the latest results; this
turns the JSON lines that `benchmarks.run --output FILE` appended into the
tables pasted there, so the README never drifts from what was measured.
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence


def variant_label(setup: str, policy: str = "float32", table_dtype: str = "float32") -> str:
    """``hybrid_sync``, ``hybrid_sync mixed_float16``, ``hybrid_sync bfloat16 tables``..."""
    return " ".join([setup] + ([policy] if policy != "float32" else [])
                    + ([f"{table_dtype} tables"] if table_dtype != "float32" else []))


def record_label(r: Dict) -> str:
    """A throughput record's setup with its policy and table dtype (if not float32)."""
    return variant_label(r["setup"], r.get("policy") or "float32",
                         r.get("table_dtype") or "float32")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _rss(r: Dict) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in r.get("peak_rss_mb", {}).items())


def _table(columns: List[str], rows: List[List[str]]) -> str:
    """A Markdown table; a column named with a trailing ">" is right-aligned."""
    header = [c.rstrip(">") for c in columns]
    align = ["---:" if c.endswith(">") else "---" for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def throughput(records: List[Dict]) -> str:
    return _table(
        ["setup", "examples/s>", "x single>", "x stock PSS>", "examples/CPU-s>",
         "x single (CPU)>", "x stock PSS (CPU)>", "peak RSS MiB"],
        [[record_label(r), _fmt(r["examples_per_sec"], ".0f"), _fmt(r["ratio_to_single"], ".2f"),
          _fmt(r["ratio_to_stock_pss"], ".2f"), _fmt(r.get("examples_per_cpu_sec"), ".0f"),
          _fmt(r.get("cpu_ratio_to_single"), ".2f"), _fmt(r.get("cpu_ratio_to_stock_pss"), ".2f"),
          _rss(r)] for r in records])


def scaling(records: List[Dict]) -> str:
    return _table(
        ["setup", "workers>", "processes on cores", "examples/s>", "examples/CPU-s>",
         "peak RSS MiB"],
        [[r["setup"], str(r["num_workers"]),
          f"{r['processes']} on {r['cpus']}{' (oversubscribed)' if r['oversubscribed'] else ''}",
          _fmt(r["examples_per_sec"], ".0f"), _fmt(r.get("examples_per_cpu_sec"), ".0f"), _rss(r)]
         for r in records])


def memory(records: List[Dict]) -> str:
    roles = ["chief", "worker:0", "worker:1", "ps:0", "ps:1"]
    return _table(
        ["table rows x 16>", "table", "(table + slots) per PS MiB>"] + [f"{x}>" for x in roles]
        + ["PS peak / share>", "(PS peak - idle PS) / share>", "(PS peak - idle PS) B/row>"],
        [[f"{r['table_rows']:,}", r.get("table_dtype", "float32"),
          f"{r['table_plus_slots_per_ps_mb']:.0f}"]
         + [_fmt(r.get("peak_rss_mb", {}).get(x), ".0f") for x in roles]
         + [f"{max(r['ps_peak_over_share'].values(), default=float('nan')):.2f}",
            f"{max(r['ps_growth_over_share'].values(), default=float('nan')):.2f}",
            _fmt(max(r.get("ps_growth_bytes_per_row", {}).values(), default=None), ".1f")]
         for r in records])


def balance(records: List[Dict]) -> str:
    return _table(
        ["ids", "PS shards>", "scheme", "lookups max/mean>", "distinct rows max/mean>"],
        [[r["ids"], str(r["num_shards"]), r["scheme"], f"{r['max_over_mean']:.3f}",
          f"{r['unique_max_over_mean']:.3f}"] for r in records])


def ablation(records: List[Dict]) -> str:
    return _table(
        ["setup", "plugin", "variant", "steps_per_execution>", "examples/s>", "examples/CPU-s>"],
        [[r["setup"], r["plugin"].split(" (")[-1].rstrip(")"), r["variant"],
          str(r["steps_per_execution"]), _fmt(r["examples_per_sec"], ".0f"),
          _fmt(r.get("examples_per_cpu_sec"), ".0f")] for r in records])


FORMATTERS = {"throughput": throughput, "scaling": scaling, "memory": memory,
              "balance": balance, "ablation": ablation}


def render(records: List[Dict]) -> str:
    """Markdown for every mode present in `records`, machine line first."""
    out = []
    machine = next((r["machine"] for r in records if "machine" in r), None)
    if machine:
        out.append(f"Machine: {machine.get('nproc')} CPUs, {machine.get('mem_gib')} GiB RAM, "
                   f"load average at start {machine.get('loadavg_at_start')}, "
                   f"{machine.get('date')}, plugin {machine.get('plugin')}.")
    tf_version = next((r.get("tf_version") for r in records if r.get("tf_version")), None)
    if tf_version:
        out.append(f"TensorFlow {tf_version}.")
    for mode, fmt in FORMATTERS.items():
        rows = [r for r in records if r.get("mode") == mode]
        if rows:
            out.append(fmt(rows))
    return "\n\n".join(out)


def throughput_chart(records: Sequence[Dict], path: str, title: str = "") -> Optional[str]:
    """A PNG bar chart of examples/s and examples per CPU-second per setup.

    One bar per throughput record (setups that failed get an "error" label
    instead of a bar), labelled with its ratio to stock PSS; with repeats, a
    whisker spans the runs' min..max. Returns the path, or None without
    matplotlib (the `bench` extra).
    """
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        sys.stderr.write("[report] no chart: pip install -e .[bench] for matplotlib\n")
        return None
    rows = [r for r in records if r.get("mode", "throughput") == "throughput" and "setup" in r]
    setups = [record_label(r) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("examples_per_sec", "ratio_to_stock_pss", "ratio_to_float32", "examples/s"),
              ("examples_per_cpu_sec", "cpu_ratio_to_stock_pss", "cpu_ratio_to_float32",
               "examples per CPU-second"))
    for ax, (key, ratio_key, f32_key, label) in zip(axes, panels):
        values = [r.get(key) or 0.0 for r in rows]
        colors = ["tab:orange" if s.startswith("hybrid") else
                  "tab:blue" if s == "stock_pss" else "tab:gray" for s in setups]
        bars = ax.bar(range(len(rows)), values, color=colors)
        for i, (bar, r) in enumerate(zip(bars, rows)):
            runs = r.get("runs_examples_per_sec") or []
            top = bar.get_height()
            if key == "examples_per_sec" and len(runs) > 1:
                ax.plot([i, i], [min(runs), max(runs)], color="black", linewidth=1)
                top = max(top, max(runs))
            if not r.get(key):
                text = "error"
            elif r.get(ratio_key) is not None:
                text = f"{r[key]:.0f}\n{r[ratio_key]:.2f}x stock"
            elif r.get(f32_key) is not None:  # --mixed_precision / --table_dtype runs.
                text = f"{r[key]:.0f}\n{r[f32_key]:.2f}x float32"
            else:
                text = f"{r[key]:.0f}"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, top),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(setups, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.18)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    p.add_argument("files", nargs="+", help="JSON lines written by benchmarks.run --output")
    p.add_argument("--chart", default=None,
                   help="also write a PNG bar chart of the throughput records to this path")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    records = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            records.extend(json.loads(line) for line in f if line.strip())
    sys.stdout.write(render(records) + "\n")
    if args.chart:
        machine = next((r["machine"] for r in records if "machine" in r), {})
        plugin = str(machine.get("plugin", "")).split(" (")[0]  # Without the local path.
        throughput_chart(records, args.chart,
                         title=f"{machine.get('nproc', '?')} CPUs, {machine.get('date', '')}, "
                               f"plugin {plugin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
