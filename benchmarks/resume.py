"""`python -m benchmarks.resume`: how soon a restarted job's input gives its first batch.

Why this module exists: a job restarted late in a long run must not spend
minutes re-reading the input it already trained on. Two ways to resume the
input are measured side by side, in one cluster (chief, 2 workers, 1 PS on
loopback), at several positions (steps already done):

* ``skip``: build the dataset with `Dataset.skip(position)` (what
  keras_examples/ctr.py did for Criteo files): each worker reads and
  parses every skipped record again;
* ``restore``: `tf_psplugin.state.input_state` (what `ChiefCheckpoint(
  save_input_position=True)` does): each worker restores its iterator's
  saved state, a seek to the saved file offset.

Input: Criteo-format TSV files (`tf_psplugin.testing.write_criteo_fixture`)
read by `tf_psplugin.data.criteo_tsv_dataset`, sharded by file (each worker
its own files). For each position the chief advances a fresh iterator by
that many steps (one batch per worker per step), saves its state, then
times, for each method, a new per-worker iterator from creation to the
first step's result, and checks that both give the same batch. JSON lines:
``position_steps``, ``method``, ``first_step_seconds``, ``same_batch``,
``state_bytes`` (restore); a summary line with the ratios and whether the
restore time stayed flat (the largest position's within 2x of the
smallest's). ``--chart`` draws the times.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence

from benchmarks import procs

RESULT_PREFIX = "RESUME_RESULT "
FLAT_FACTOR = 2.0

CHIEF = r'''
import json, os, sys, time
import tensorflow as tf
import tf_psplugin
from tf_psplugin.data import criteo_tsv_dataset
from tf_psplugin.state import input_state

files, batch, positions, scratch = (json.loads(sys.argv[1]), int(sys.argv[2]),
                                    json.loads(sys.argv[3]), sys.argv[4])
tf_psplugin.start_server()
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def dataset(skip=0):
    ds = criteo_tsv_dataset(files, batch, vocab_size=1000, repeat=True)
    return ds.skip(skip) if skip else ds


@tf.function
def advance(iterator, n):
    for _ in tf.range(n):
        next(iterator)
    return tf.constant(0)


@tf.function
def first_batch(iterator):
    features, label = next(iterator)
    return tf.reduce_sum(features["dense"]) + tf.cast(tf.reduce_sum(features["categorical"]),
                                                      tf.float32)


# Warm up: trace both functions on a throwaway iterator.
it = iter(coordinator.create_per_worker_dataset(dataset()))
coordinator.schedule(advance, args=(it, tf.constant(1, tf.int64)))
coordinator.schedule(first_batch, args=(it,)).fetch()
for position in positions:
    path = os.path.join(scratch, f"ckpt-{position}")
    it = iter(coordinator.create_per_worker_dataset(dataset()))
    start = time.monotonic()
    coordinator.schedule(advance, args=(it, tf.constant(position, tf.int64)))
    coordinator.join()
    advanced = time.monotonic() - start
    start = time.monotonic()
    input_state.save(it, path)
    saved = time.monotonic() - start
    size = sum(os.path.getsize(os.path.join(path + ".input", f))
               for f in os.listdir(path + ".input"))
    del it
    results = {}
    for method in ("restore", "skip"):
        start = time.monotonic()
        fresh = iter(coordinator.create_per_worker_dataset(
            dataset(skip=position if method == "skip" else 0)))
        if method == "restore":
            assert input_state.restore(fresh, path)
        value = float(coordinator.schedule(first_batch, args=(fresh,)).fetch())
        results[method] = (time.monotonic() - start, value)
        del fresh
    for method, (seconds, value) in results.items():
        print("RESUME_RESULT " + json.dumps({
            "position_steps": position, "method": method,
            "first_step_seconds": round(seconds, 3),
            "same_batch": results["restore"][1] == results["skip"][1],
            "state_bytes": size if method == "restore" else None,
            "advance_seconds": round(advanced, 2), "save_seconds": round(saved, 3)}), flush=True)
'''


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resume",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", default="1000,10000,50000",
                   help="comma-separated steps already done at the restart")
    p.add_argument("--batch", type=int, default=16, help="lines per batch per worker")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="--positions 1000,50000 --batch 4")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--chart", default="", help="PNG of the first-step times")
    p.add_argument("--log_dir", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.positions, args.batch = "1000,50000", 4
    args.position_list = sorted(int(x) for x in args.positions.split(",") if x)
    if not args.position_list or args.position_list[0] < 1 or args.files < 2:
        p.error("--positions must be >= 1 and --files >= 2 (one per worker at least)")
    return args


def write_files(folder: str, files: int, rows_per_file: int) -> List[str]:
    from tf_psplugin.testing import write_criteo_fixture  # pylint: disable=g-import-not-at-top

    return [write_criteo_fixture(os.path.join(folder, f"day-{f}.tsv"), rows_per_file, seed=f)
            for f in range(files)]


def write_chart(records: List[dict], path: str) -> str:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method, marker in (("skip", "s"), ("restore", "o")):
        rows = sorted((r for r in records if r.get("method") == method),
                      key=lambda r: r["position_steps"])
        ax.plot([r["position_steps"] for r in rows], [r["first_step_seconds"] for r in rows],
                marker=marker, label={"skip": "Dataset.skip (re-read)",
                                      "restore": "saved iterator state (seek)"}[method])
    ax.set(xscale="log", xlabel="steps done before the restart",
           ylabel="seconds from a new iterator to the first batch",
           title="Resuming the input: 2 workers, Criteo TSV by file")
    ax.grid(alpha=0.3)
    ax.legend()
    return procs.save_chart(fig, plt, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    args = parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_resume_")
    data = tempfile.mkdtemp(prefix="tf_psplugin_resume_data_")
    workers = 2
    records = []
    emit = procs.json_lines_emitter(args.output)

    try:
        # Each worker reads files // workers files; enough lines for the
        # largest position plus the warm-up and the first batch.
        rows = (max(args.position_list) + 16) * args.batch // (args.files // workers) + 1
        files = write_files(data, args.files, rows)
        script = os.path.join(log_dir, "resume_chief.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(CHIEF)
        log = os.path.join(log_dir, "resume.log")
        with open(log, "w", encoding="utf-8") as out:
            with LocalCluster(num_workers=workers, num_ps=1, servers="builtin",
                              env=procs.child_env(), output=out, grace_period=2.0) as cluster:
                cluster.start_servers()
                procs.wait_until_serving(cluster, workers + 1, log)
                result = cluster.run_chief(
                    [sys.executable, script, json.dumps(files), str(args.batch),
                     json.dumps(args.position_list), data], timeout=3000)
                text = "".join(cluster.output("chief"))
        if result.returncode != 0 or RESULT_PREFIX not in text:
            raise procs.BenchmarkProcessError(f"chief exited {result.returncode}; log {log}")
        for line in text.splitlines():
            if RESULT_PREFIX in line:
                record = {"kind": "resume", "workers": workers, "batch": args.batch,
                          "files": args.files, "rows_per_file": rows,
                          **json.loads(line.split(RESULT_PREFIX, 1)[1])}
                records.append(record)
                emit(record)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    by = {(r["position_steps"], r["method"]): r["first_step_seconds"] for r in records}
    low, high = args.position_list[0], args.position_list[-1]
    emit({"kind": "resume_summary",
          "restore_seconds": {str(p): by[(p, "restore")] for p in args.position_list},
          "skip_seconds": {str(p): by[(p, "skip")] for p in args.position_list},
          "skip_to_restore_at_largest": round(by[(high, "skip")] / by[(high, "restore")], 1),
          "restore_largest_to_smallest": round(by[(high, "restore")] / by[(low, "restore")], 2),
          "restore_flat": by[(high, "restore")] <= FLAT_FACTOR * by[(low, "restore")],
          "same_batch": all(r["same_batch"] for r in records)})
    if args.chart:
        print(f"chart: {write_chart(records, args.chart)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
