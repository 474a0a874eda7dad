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


def throughput(records: List[Dict]) -> str:
    lines = ["| setup | examples/s | x single | x stock PSS | examples/CPU-s | x single (CPU) "
             "| x stock PSS (CPU) | peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        lines.append(
            f"| {r['setup']} | {_fmt(r['examples_per_sec'], '.0f')} "
            f"| {_fmt(r['ratio_to_single'], '.2f')} | {_fmt(r['ratio_to_stock_pss'], '.2f')} "
            f"| {_fmt(r.get('examples_per_cpu_sec'), '.0f')} "
            f"| {_fmt(r.get('cpu_ratio_to_single'), '.2f')} "
            f"| {_fmt(r.get('cpu_ratio_to_stock_pss'), '.2f')} | {_rss(r)} |")
    return "\n".join(lines)


def scaling(records: List[Dict]) -> str:
    lines = ["| setup | workers | processes on cores | examples/s | examples/CPU-s | "
             "peak RSS MiB |", "|---|---:|---|---:|---:|---|"]
    for r in records:
        lines.append(f"| {r['setup']} | {r['num_workers']} | {r['processes']} on {r['cpus']}"
                     f"{' (oversubscribed)' if r['oversubscribed'] else ''} "
                     f"| {_fmt(r['examples_per_sec'], '.0f')} "
                     f"| {_fmt(r.get('examples_per_cpu_sec'), '.0f')} | {_rss(r)} |")
    return "\n".join(lines)


def memory(records: List[Dict]) -> str:
    lines = ["| table rows x 16 | (table + slots) per PS MiB | chief | worker:0 | worker:1 "
             "| ps:0 | ps:1 | PS peak / share | (PS peak - idle PS) / share |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        p = r.get("peak_rss_mb", {})
        lines.append(
            f"| {r['table_rows']:,} | {r['table_plus_slots_per_ps_mb']:.0f} "
            f"| {_fmt(p.get('chief'), '.0f')} | {_fmt(p.get('worker:0'), '.0f')} "
            f"| {_fmt(p.get('worker:1'), '.0f')} | {_fmt(p.get('ps:0'), '.0f')} "
            f"| {_fmt(p.get('ps:1'), '.0f')} "
            f"| {max(r['ps_peak_over_share'].values(), default=float('nan')):.2f} "
            f"| {max(r['ps_growth_over_share'].values(), default=float('nan')):.2f} |")
    return "\n".join(lines)


def balance(records: List[Dict]) -> str:
    lines = ["| ids | PS shards | scheme | lookups max/mean | distinct rows max/mean |",
             "|---|---:|---|---:|---:|"]
    for r in records:
        lines.append(f"| {r['ids']} | {r['num_shards']} | {r['scheme']} "
                     f"| {r['max_over_mean']:.3f} | {r['unique_max_over_mean']:.3f} |")
    return "\n".join(lines)


def ablation(records: List[Dict]) -> str:
    lines = ["| setup | plugin | variant | steps_per_execution | examples/s | examples/CPU-s |",
             "|---|---|---|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['setup']} | {r['plugin'].split(' (')[-1].rstrip(')')} "
                     f"| {r['variant']} | {r['steps_per_execution']} "
                     f"| {_fmt(r['examples_per_sec'], '.0f')} "
                     f"| {_fmt(r.get('examples_per_cpu_sec'), '.0f')} |")
    return "\n".join(lines)


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
