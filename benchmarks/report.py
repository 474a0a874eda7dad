"""`python -m benchmarks.report FILE.jsonl ...`: Markdown tables from benchmark JSON lines.

Why this module exists: benchmarks/README.md carries the latest results; this
turns the JSON lines that `benchmarks.run --output FILE` appended into the
tables pasted there, so the README never drifts from what was measured.
"""

import json
import sys
from typing import Dict, List


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
        [[r["setup"], _fmt(r["examples_per_sec"], ".0f"), _fmt(r["ratio_to_single"], ".2f"),
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
        ["table rows x 16>", "(table + slots) per PS MiB>"] + [f"{x}>" for x in roles]
        + ["PS peak / share>", "(PS peak - idle PS) / share>"],
        [[f"{r['table_rows']:,}", f"{r['table_plus_slots_per_ps_mb']:.0f}"]
         + [_fmt(r.get("peak_rss_mb", {}).get(x), ".0f") for x in roles]
         + [f"{max(r['ps_peak_over_share'].values(), default=float('nan')):.2f}",
            f"{max(r['ps_growth_over_share'].values(), default=float('nan')):.2f}"]
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    records = []
    for path in argv:
        with open(path, encoding="utf-8") as f:
            records.extend(json.loads(line) for line in f if line.strip())
    sys.stdout.write(render(records) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
