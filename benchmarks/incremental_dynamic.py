"""`python -m benchmarks.incremental_dynamic`: a delta vs a full save of a `DynamicEmbedding`.

Why this module exists: `benchmarks.incremental` measures deltas of a
static table; a `DynamicEmbedding` delta also carries each changed row's
state (last use, hits), its key or its deletion, and the admission
sketch's changed counters (`tf_psplugin.state.incremental_dynamic`), and its full
save holds the whole sketch and key map too. This measures what that
costs, on one loopback cluster (chief, 1 worker, 2 PS).

The layer: ``--capacity`` rows x ``--dim`` float32 (default 1M x 16),
``admit_after=2`` (so a sketch of ``2 x 4 x capacity`` int64 counters),
LRU eviction, Keras legacy Adagrad, under `ChiefCheckpointManager(full_every_saves=2)`.
The table is filled first (every key seen twice). Then, per fraction of the
capacity (default 1% and 10%): a full save (timed), one training step whose
keys are that fraction of the rows: 90% keys the table holds, 10% new keys
seen twice (admitted, evicting as many LRU rows, whose keys the delta
deletes), then a delta save (timed).

JSON lines (kind ``incremental_dynamic``): ``capacity``, ``dim``,
``touched_fraction``, ``delta_rows`` (rows in the delta), ``delta_deleted``
(rows in it that hold no key now), ``delta_sketch_counters``,
``full_bytes``, ``delta_bytes`` (every file, markers excluded),
``full_seconds``, ``delta_seconds`` (the `save` call), ``table_stats``.
Exactness is what tests/cluster/test_incremental_dynamic.py checks.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Optional, Sequence

from benchmarks import procs

RESULT_PREFIX = "INCREMENTAL_DYNAMIC_RESULT "

CHIEF = r'''
import json, os, sys, time
import numpy as np
import tensorflow as tf
import tf_psplugin
from tf_psplugin import layers

capacity, dim, fractions, model_dir = (int(sys.argv[1]), int(sys.argv[2]),
                                       json.loads(sys.argv[3]), sys.argv[4])
FEATURES, BATCH = 16, 4096
tf_psplugin.start_server()
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
with strategy.scope():
    inp = tf.keras.Input((FEATURES,), dtype=tf.int64)
    x = layers.DynamicEmbedding(dim, capacity=capacity, admit_after=2, eviction="lru",
                                name="dyn")(inp)
    out = tf.keras.layers.Dense(1, name="out")(tf.keras.layers.Flatten()(x))
    model = tf.keras.Model(inp, out)
    model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
manager = tf_psplugin.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer,
                                             full_every_saves=2, max_to_keep=1)
dyn = model.get_layer("dyn")


def fit(keys):
    """Trains on `keys` (1-D), FEATURES per example, one step per BATCH examples."""
    keys = np.concatenate([keys, keys[:(-len(keys)) % FEATURES]]).reshape(-1, FEATURES)
    y = np.ones((len(keys), 1), np.float32)
    steps = -(-len(keys) // BATCH)
    model.fit(tf.data.Dataset.from_tensor_slices((keys, y)).batch(BATCH), epochs=1,
              steps_per_epoch=steps, verbose=0)


rng = np.random.RandomState(0)
held = np.arange(capacity, dtype=np.int64) * 7919 + 1
fill = rng.permutation(held)
fit(np.concatenate([fill, fill]))  # Seen twice: admitted.
fresh = 10 ** 12
# Save numbers, not optimizer steps: a full save right after a delta (no
# step between) is a save of its own.
save_number = int(model.optimizer.iterations.numpy())
for fraction in fractions:
    save_number += 1
    full_start = time.perf_counter()
    full = manager.save(save_number)
    full_seconds = time.perf_counter() - full_start
    assert full.kind == "full", full
    count = max(10, int(round(fraction * capacity)))
    keys_now, _ = (t.numpy() for t in dyn.key_index.export())
    old = rng.choice(keys_now, size=count - count // 10, replace=False)
    new = np.arange(fresh, fresh + count // 10, dtype=np.int64)
    fresh += count // 10
    batch = rng.permutation(np.concatenate([old, new, new]))
    fit(batch)
    delta_start = time.perf_counter()
    save_number += 1
    delta = manager.save(save_number)
    delta_seconds = time.perf_counter() - delta_start
    assert delta.kind == "delta", delta
    with open(delta.path + ".commit") as f:
        manifest = json.load(f)["manifest"]
    [entry] = manifest["dynamic"].values()
    rows = deleted = counters = 0
    for row_file in manifest["row_files"]:
        reader = tf.train.load_checkpoint(os.path.join(model_dir, row_file))
        flags = reader.get_tensor(entry["key_index"] + "/.DELTA/held")
        rows += len(flags)
        deleted += int((~flags).sum())
        counters += len(reader.get_tensor(entry["sketch"] + "/.DELTA/ids"))
    stats = dyn.table_stats()
    print("INCREMENTAL_DYNAMIC_RESULT " + json.dumps({
        "capacity": capacity, "dim": dim, "touched_fraction": fraction,
        "step_keys": int(len(batch)), "delta_rows": rows, "delta_deleted": deleted,
        "delta_sketch_counters": counters,
        "full_bytes": sum(full.files.values()), "delta_bytes": sum(delta.files.values()),
        "full_seconds": round(full_seconds, 3), "delta_seconds": round(delta_seconds, 3),
        "table_stats": {k: sum(s[k] for s in stats) for k in ("size", "admitted", "evicted")},
        "tf_version": tf.__version__}), flush=True)
'''


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.incremental_dynamic",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=1_000_000, help="rows of the layer")
    p.add_argument("--dim", type=int, default=16, help="row width (float32)")
    p.add_argument("--fractions", default="0.01,0.1",
                   help="comma-separated fractions of the capacity one step touches")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--log_dir", default=None)
    p.add_argument("--timeout", type=float, default=1200.0)
    args = p.parse_args(argv)
    args.fraction_list = [float(x) for x in args.fractions.split(",") if x]
    if not args.fraction_list or not all(0 < f <= 0.5 for f in args.fraction_list):
        p.error("--fractions must be in (0, 0.5]")
    if args.capacity < 1000 or args.dim < 1:
        p.error("--capacity must be >= 1000, --dim >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    args = parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_incremental_dynamic_")
    os.makedirs(log_dir, exist_ok=True)
    model_dir = tempfile.mkdtemp(prefix="tf_psplugin_incremental_dynamic_ckpt_")
    emit = procs.json_lines_emitter(args.output)
    try:
        script = os.path.join(log_dir, "incremental_dynamic_chief.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(CHIEF)
        log = os.path.join(log_dir, "incremental_dynamic.log")
        with open(log, "w", encoding="utf-8") as out:
            with LocalCluster(num_workers=1, num_ps=2, servers="builtin",
                              env=procs.child_env(), output=out, grace_period=2.0) as cluster:
                cluster.start_servers()
                procs.wait_until_serving(cluster, 3, log)
                result = cluster.run_chief(
                    [sys.executable, script, str(args.capacity), str(args.dim),
                     json.dumps(args.fraction_list), model_dir], timeout=args.timeout)
                text = "".join(cluster.output("chief"))
        if result.returncode != 0 or RESULT_PREFIX not in text:
            raise procs.BenchmarkProcessError(f"chief exited {result.returncode}; log {log}")
        for line in text.splitlines():
            if RESULT_PREFIX in line:
                emit({"kind": "incremental_dynamic", "num_ps": 2, "workers": 1,
                      "optimizer": "legacy.Adagrad", "full_every": 2,
                      **json.loads(line.split(RESULT_PREFIX, 1)[1])})
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
