"""`python -m benchmarks.input`: what each worker reads, and how soon training starts.

Why this module exists: in synchronous training every worker runs every
step, so an input pipeline that every worker reads in full (and a pass that
counts it first) multiplies the job's reads by the number of workers. This
benchmark writes TFRecord files, then for each number of workers `W` runs
one cluster on loopback per sharding policy, side by side:

* ``auto``: a plain `tf.data.TFRecordDataset` pipeline, the default; the
  coordinator applies tf.data's auto-shard rewrite (by file here);
* ``by_batch``: the same pipeline with `AutoShardPolicy.DATA`, i.e. what the
  plugin did before (every worker reads every file, keeps every W-th batch).

The chief trains a small model on one epoch of the data with a custom loop
(no `steps_per_epoch`, unknown length: the end is agreed step by step, no
counting pass). Per run it reports, as JSON lines: the time from the first
`schedule` to the first step's result, the bytes each worker read from files
while training (`rchar` of `/proc/<pid>/io`, counted from after its server
came up) against its share (total bytes / W), and examples/s. ``--chart``
draws both. Target: each worker reads <= 1.1x its share with ``auto``.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
from typing import List, Optional, Sequence

from benchmarks import procs

POLICIES = ("auto", "by_batch")
SHARE_TARGET = 1.1
RESULT_PREFIX = "INPUT_RESULT "

CHIEF = r'''
import json, sys, time
import tensorflow as tf
import tf_psplugin

import os
files, policy, batch, go = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
tf_psplugin.start_server()
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
spec = {"ids": tf.io.FixedLenFeature([8], tf.int64), "label": tf.io.FixedLenFeature([], tf.float32),
        "pad": tf.io.FixedLenFeature([], tf.string)}
ds = tf.data.TFRecordDataset(files).map(lambda r: tf.io.parse_single_example(r, spec)).batch(batch)
if policy == "by_batch":
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = ds.with_options(options)
with strategy.scope():
    emb = tf.keras.layers.Embedding(10000, 8)
    dense = tf.keras.layers.Dense(1)
    model = tf.keras.Sequential([tf.keras.Input((8,), dtype="int64"), emb,
                                 tf.keras.layers.GlobalAveragePooling1D(), dense])
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.1)
    examples = tf.keras.metrics.Sum()

@tf.function
def step(iterator):
    batch = next(iterator)
    def replica_fn(ids, label):
        with tf.GradientTape() as tape:
            logits = tf.squeeze(model(ids, training=True), -1)
            loss = tf.nn.compute_average_loss(
                tf.nn.sigmoid_cross_entropy_with_logits(label, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        examples.update_state(tf.cast(tf.shape(ids)[0], tf.float32))
    return strategy.run(replica_fn, args=(batch["ids"], batch["label"]))

print("INPUT_READY", flush=True)
while not os.path.exists(go):  # The parent has read every worker's counters.
    time.sleep(0.05)
t0 = time.monotonic()
it = iter(coordinator.create_per_worker_dataset(ds))
first = coordinator.schedule(step, args=(it,))
coordinator.join()
t_first = time.monotonic() - t0
try:
    while True:
        for _ in range(20):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
except tf.errors.OutOfRangeError:
    pass  # The epoch ended on every worker at the same step.
seconds = time.monotonic() - t0
print("INPUT_RESULT " + json.dumps({"time_to_first_step_s": round(t_first, 3),
                                    "examples": int(examples.result()),
                                    "seconds": round(seconds, 3)}), flush=True)
'''


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.input", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--workers", default="2,4,8", help="comma-separated numbers of workers")
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--records_per_file", type=int, default=20_000)
    p.add_argument("--record_bytes", type=int, default=512, help="padding per record")
    p.add_argument("--batch", type=int, default=256, help="batch per worker")
    p.add_argument("--quick", action="store_true", help="--workers 2,4 --records_per_file 5000")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--chart", default="", help="PNG of bytes read and time to first step")
    p.add_argument("--log_dir", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.records_per_file = "2,4", 5000
    args.worker_counts = [int(w) for w in args.workers.split(",") if w]
    if not args.worker_counts or min(args.worker_counts) < 1 or args.files < max(
            args.worker_counts):
        p.error("--workers must be >= 1 and at most --files")
    return args


def write_files(folder: str, files: int, records: int, pad: int) -> List[str]:
    """TFRecord files of records (8 ids, a label, `pad` bytes of padding)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    rng = np.random.default_rng(0)
    paths = []
    for f in range(files):
        path = os.path.join(folder, f"part-{f:03d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(records):
                ids = rng.integers(0, 10_000, 8)
                example = tf.train.Example(features=tf.train.Features(feature={
                    "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=ids)),
                    "label": tf.train.Feature(float_list=tf.train.FloatList(
                        value=[float(ids[0] % 2)])),
                    "pad": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"x" * pad])),
                }))
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def read_chars(pid: int) -> Optional[int]:
    """Bytes the process has read through read() calls (files and sockets)."""
    try:
        with open(f"/proc/{pid}/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_one(files: List[str], policy: str, workers: int, args, log_dir: str) -> dict:
    """One cluster: the chief's timings and each worker's bytes read while training."""
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    total = sum(os.path.getsize(f) for f in files)
    log = os.path.join(log_dir, f"input-{policy}-{workers}.log")
    script = os.path.join(log_dir, "input_chief.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(CHIEF)
    with open(log, "w", encoding="utf-8") as out:
        with LocalCluster(num_workers=workers, num_ps=1, servers="builtin",
                          env=procs.child_env(), output=out, grace_period=2.0) as cluster:
            cluster.start_servers()
            procs.wait_until_serving(cluster, workers + 1, log)
            pids = {role: pid for role, pid in cluster.pids().items()
                    if role.startswith("worker")}
            go = os.path.join(log_dir, f"go-{policy}-{workers}")
            done = {}

            def run_chief():
                done["result"] = cluster.run_chief(
                    [sys.executable, script, json.dumps(files), policy, str(args.batch), go],
                    timeout=900)

            thread = threading.Thread(target=run_chief, daemon=True)
            thread.start()
            if not cluster.wait_for_output("INPUT_READY", "chief", timeout=600):
                raise procs.BenchmarkProcessError(f"chief did not start; log {log}")
            before = {role: read_chars(pid) for role, pid in pids.items()}
            open(go, "w").close()
            thread.join(timeout=900)
            after = {role: read_chars(pid) for role, pid in pids.items()}
            code = done["result"].returncode if "result" in done else None
            text = "".join(cluster.output("chief"))
    if code != 0 or RESULT_PREFIX not in text:
        raise procs.BenchmarkProcessError(f"chief exited {code}; log {log}")
    result = json.loads(text.rsplit(RESULT_PREFIX, 1)[1].splitlines()[0])
    read = {role: after[role] - before[role] for role in sorted(pids)}
    share = total / workers
    examples = result["examples"]
    return {
        "kind": "input", "policy": policy, "workers": workers, "files": len(files),
        "file_bytes": total, "share_bytes": round(share),
        "read_bytes": read, "max_read_to_share": round(max(read.values()) / share, 3),
        "time_to_first_step_s": result["time_to_first_step_s"],
        "examples": examples, "records": len(files) * args.records_per_file,
        "examples_per_sec": round(examples / result["seconds"], 1),
    }


def write_chart(records: List[dict], path: str) -> str:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, marker in zip(POLICIES, "os"):
        rows = sorted((r for r in records if r["policy"] == policy), key=lambda r: r["workers"])
        w = [r["workers"] for r in rows]
        ax1.plot(w, [r["max_read_to_share"] for r in rows], marker=marker, label=policy)
        ax2.plot(w, [r["time_to_first_step_s"] for r in rows], marker=marker, label=policy)
    ax1.axhline(SHARE_TARGET, color="grey", ls=":", label=f"target {SHARE_TARGET}x")
    ax1.set(xlabel="workers", ylabel="bytes a worker read / its share (max over workers)",
            title="Input read per worker")
    ax2.set(xlabel="workers", ylabel="seconds", title="Time to the first step")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    return procs.save_chart(fig, plt, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_input_")
    data = tempfile.mkdtemp(prefix="tf_psplugin_input_data_")
    records = []
    emit = procs.json_lines_emitter(args.output)

    try:
        files = write_files(data, args.files, args.records_per_file, args.record_bytes)
        for workers in args.worker_counts:
            for policy in POLICIES:
                record = run_one(files, policy, workers, args, log_dir)
                records.append(record)
                emit(record)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    auto = [r for r in records if r["policy"] == "auto"]
    emit({"kind": "input_summary",
          "max_read_to_share_auto": max(r["max_read_to_share"] for r in auto),
          "target": SHARE_TARGET,
          "target_met": all(r["max_read_to_share"] <= SHARE_TARGET for r in auto)})
    if args.chart:
        print(f"chart: {write_chart(records, args.chart)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
