"""`python -m benchmarks.incremental`: delta vs full saves of a 10M-row table; serving freshness.

Why this module exists: incremental checkpoints (`ChiefCheckpointManager(
full_every_saves=K)`, `tf_psplugin.state.incremental`) are worth having only if a delta
of the rows a job touched between saves is much smaller and faster than a
full save, and restores exactly. This measures both on one loopback
cluster (chief, 1 worker, 2 PS): one table of ``--rows`` x ``--dim``
float32 (default 10M x 16, 640 MB) trained with ``--optimizer``: Keras's
legacy Adagrad (the default; its accumulator is another 640 MB), Keras's
(new) Adagrad, or `tf_psplugin.LazyAdam` (two moments, 1.28 GB), plus a
small dense layer. ``--stack_tables`` is passed to the strategy (a 10M-row
table is too large to be stacked either way: ``table_stacked`` says).

For each fraction of rows touched (default 1% and 10%), with
``full_every_saves=2`` and ``max_to_keep=1``: a full save (timed), one training
step whose gradient touches exactly that fraction of the rows (evenly
spread ids, so every PS has its share), a delta save (timed), then a second
model on the same cluster (built for the check and dropped after it, so it
never coexists with a full save's buffers) restores the chain (full +
delta) and is compared
with the trained one on the PS tasks, shard by shard (table, every
optimizer variable, paired by name) and every dense variable
(`restore_exact`: all bitwise equal).

Freshness, with a real serving process. After the first full save the
chief exports it (`export_from_checkpoint`) and starts a separate process
(no ``TF_CONFIG``, no cluster) that loads the export as a
`tf_psplugin.ServingModel` and follows the model directory on its own:
every ``--serving_poll_seconds`` (0.5) it polls; after a poll that applied
something it answers a request (the model's output for 8 ids the step
touched, ids the chief left in a probe file before the step) and reports
its step, the answer and the wall time. Before each fraction's step the
chief waits until the serving process is at the full save (later
fractions: it reloaded that full checkpoint). ``serving_freshness_seconds``
is the time from the step's update being on the PS tasks (the
coordinator's join returned) to the serving process answering at the
delta's step: the delta save, up to one poll interval, reading and
applying the delta, the request. ``serving_exact``: that answer is the
delta's step and equals the trained rows through the trained Dense layer
(computed on the chief, ``rtol`` 1e-5).

JSON lines (kind ``incremental``): the run's options (``optimizer``,
``optimizer_class``, ``stack_tables``, ``full_every``, ``max_to_keep``,
``num_ps``, ``workers``, ``fractions``, ``serving_poll_seconds``; the
summary line repeats them), ``table_stacked``, ``optimizer_variables``
(how many were compared), ``rows``, ``dim``, ``touched_fraction``,
``delta_rows`` (ids in the delta), ``full_bytes``, ``delta_bytes`` (every
file of each, markers excluded), ``full_seconds``, ``delta_seconds`` (the
`save` call: join, pull, write, commit), ``restore_seconds`` (full + delta
into the second model), ``restore_exact``, ``peak_rss_mb`` (every process,
at the end of the run; the serving process's when it answered),
``serving_freshness_seconds``, ``serving_exact``, ``serving_apply_seconds``
(the serving process's `poll` that applied the delta),
``serving_poll_seconds``, ``export_seconds`` (the export the serving
process starts from), ``serving_load_seconds`` (loading it),
``serving_reload_seconds`` and ``serving_reloaded`` (from the second
fraction on: the serving process's poll that reloaded the new full
checkpoint, and what it applied). A summary line checks the targets at
1%: delta bytes <= 5% and delta seconds <= 10% of the full save's, restore
exact; and, over every fraction, the worst freshness <= 30 s and every
serving answer exact. ``--chart`` draws bytes and seconds.

``--saves N`` instead runs N delta saves (each after a step) of a 200k x
16 table and reports every process's RSS growth per 100 saves: a save
path that leaves state behind on the PS tasks shows up there (see
`tf_psplugin.state.checkpoint_write` for the leak full saves once had).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence

from benchmarks import procs

RESULT_PREFIX = "INCREMENTAL_RESULT "
TARGET_BYTES_RATIO = 0.05
TARGET_SECONDS_RATIO = 0.10
TARGET_FRESHNESS_SECONDS = 30.0
FULL_EVERY = 2
# --optimizer: what the table (and the dense layer) train with, and its learning rate.
OPTIMIZERS = {"legacy.Adagrad": "tf.keras.optimizers.legacy.Adagrad(0.1)",
              "Adagrad": "tf.keras.optimizers.Adagrad(0.1)",
              "LazyAdam": "tf_psplugin.LazyAdam(0.01)"}

CHIEF = r'''
import gc, json, os, queue, subprocess, sys, threading, time
import numpy as np
import tensorflow as tf
import tf_psplugin
from benchmarks.procs import peak_rss_mb

rows, dim, fractions, model_dir = (int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]),
                                   sys.argv[4])
serving_script, export_dir, poll_seconds = sys.argv[5], sys.argv[6], float(sys.argv[7])
optimizer_name, stack_tables, full_every = sys.argv[8], sys.argv[9] == "true", int(sys.argv[10])
tf_psplugin.start_server()
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False, stack_tables=stack_tables))
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def architecture(seed):
    return tf.keras.Sequential([
        tf.keras.Input((None,), dtype=tf.int64, name="ids"),
        tf.keras.layers.Embedding(rows, dim, name="table", embeddings_initializer=(
            tf.keras.initializers.RandomUniform(seed=seed))),
        tf.keras.layers.Dense(1, name="out")])


def build(seed):
    with strategy.scope():
        model = architecture(seed)
        optimizer = {"legacy.Adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.1),
                     "Adagrad": lambda: tf.keras.optimizers.Adagrad(0.1),
                     "LazyAdam": lambda: tf_psplugin.LazyAdam(0.01)}[optimizer_name]()
    return model, optimizer


def optimizer_state(model, optimizer):
    """(name, variable) of every optimizer variable of the table and the dense layer."""
    if hasattr(optimizer, "get_slot_names"):  # Legacy: slots by (variable, name).
        named = [(f"{w.name}/{name}", optimizer.get_slot(w, name))
                 for w in [model.get_layer("table").embeddings] + model.get_layer("out").weights
                 for name in optimizer.get_slot_names()]
        return named + [("iterations", optimizer.iterations)]
    return [(v.name, v) for v in optimizer.variables]  # Keras's new ones: in build order.


def optimizer_mismatches(a, b):
    """Names (in `a`) of the optimizer variables of `a` and `b` (model, optimizer) that differ.

    Paired in order (both are built the same way; their names differ by
    the optimizer's and the stacks' name counters); a variable of either
    without its pair, or of another shape, differs.
    """
    a, b = optimizer_state(*a), optimizer_state(*b)
    if len(a) != len(b):
        return [f"{len(a)} vs {len(b)} optimizer variables"]
    return [n for (n, x), (_, y) in zip(a, b) if x.shape != y.shape or not equal_on_ps(x, y)]


model, optimizer = build(1)
manager = tf_psplugin.ChiefCheckpointManager(model_dir, model=model, optimizer=optimizer,
                                             full_every_saves=full_every, max_to_keep=1)


# Row i of a step is (start + i * STRIDE) % rows: distinct rows (STRIDE is a
# prime that does not divide rows), spread over every shard.
STRIDE = 7919


@tf.function
def train_step(start, count, stride):
    def replica_fn(start, count, stride):
        ids = (start + tf.range(count, dtype=tf.int64) * stride) % rows
        with tf.GradientTape() as tape:
            out = model(ids[None, :], training=True)
            loss = tf.reduce_mean(tf.square(out - 1.0))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return strategy.run(replica_fn, args=(start, count, stride))


def step(fraction, start):
    count = max(1, int(round(fraction * rows)))
    coordinator.schedule(train_step, args=(tf.constant(start, tf.int64),
                                           tf.constant(count, tf.int32),
                                           tf.constant(STRIDE, tf.int64)))
    coordinator.join()
    return count


def shards(var):
    return list(var.variables) if hasattr(var, "variables") and not isinstance(
        var, tf.Variable) else [var]


def equal_on_ps(a, b):
    """Bitwise equality computed where the shards live (nothing copied to the chief)."""
    ok = True
    for x, y in zip(shards(a), shards(b)):
        with tf.device(x.device):
            same = tf.reduce_all(tf.equal(tf.bitcast(tf.convert_to_tensor(x), tf.int32),
                                          tf.bitcast(tf.convert_to_tensor(y), tf.int32)))
        ok = ok and bool(same.numpy())
    return ok


class Serving:
    """The serving process: follows model_dir on its own, answers the probe after each poll."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}  # No cluster.
        self.proc = subprocess.Popen(
            [sys.executable, serving_script, export_dir, model_dir, probe_path,
             str(poll_seconds)], stdout=subprocess.PIPE, text=True, env=env)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("SERVING "):
                self.lines.put(json.loads(line[len("SERVING "):]))
            else:
                print("[serving] " + line, end="", flush=True)
        self.lines.put(None)

    def wait_for(self, step, timeout=600):
        """The first line of the serving process at `step` or later."""
        deadline = time.time() + timeout
        while True:
            line = self.lines.get(timeout=max(1.0, deadline - time.time()))
            if line is None:
                raise RuntimeError(f"the serving process exited ({self.proc.wait()})")
            if line.get("step") is not None and line["step"] >= step:
                return line

    def stop(self):
        self.proc.kill()
        self.proc.wait()


probe_path = os.path.join(os.path.dirname(export_dir), "probe.json")


def probe_ids(start):
    return [int((start + i * STRIDE) % rows) for i in range(8)]


def write_probe(ids):
    with open(probe_path + ".tmp", "w") as f:
        json.dump({"ids": ids}, f)
    os.replace(probe_path + ".tmp", probe_path)


def expected_output(ids):
    """What serving must answer for `ids` now: the trained rows through the trained Dense."""
    table = model.get_layer("table").embeddings
    found = tf.nn.embedding_lookup(table, tf.constant(ids, tf.int64)).numpy()
    kernel, bias = [w.numpy() for w in model.get_layer("out").weights]
    return (found @ kernel + bias).ravel()


assert rows % STRIDE, "rows must not be a multiple of 7919"
serving, export_seconds, serving_load_seconds = None, None, None
try:
    for n, fraction in enumerate(fractions):
        # Before the full save (so not in the delta): the first one traces the
        # step and creates the slots.
        step(0.001, 2 * n)
        iterations = int(optimizer.iterations.numpy())
        start = time.perf_counter()
        full = manager.save(iterations)
        full_seconds = time.perf_counter() - start
        assert full.kind == "full", full
        if serving is None:
            # The export the serving process starts from, made from the full checkpoint.
            start = time.perf_counter()
            tf_psplugin.export_from_checkpoint(lambda: architecture(0), model_dir, export_dir)
            export_seconds = time.perf_counter() - start
            serving = Serving()
        ready = serving.wait_for(full.step)  # Loaded the export, or reloaded this full save.
        serving_load_seconds = ready.get("load_seconds", serving_load_seconds)
        ids = probe_ids(2 * n + 1)
        write_probe(ids)
        touched = step(fraction, 2 * n + 1)
        applied_on_ps = time.time()  # The step's update is on the PS tasks (join returned).
        start = time.perf_counter()
        delta = manager.save(iterations + 1)
        delta_seconds = time.perf_counter() - start
        assert delta.kind == "delta", delta
        answer = serving.wait_for(delta.step)
        freshness = answer["answered"] - applied_on_ps
        serving_exact = (answer["checkpoint"] == delta.name and answer["ids"] == ids and
                         bool(np.allclose(answer["output"], expected_output(ids), rtol=1e-5,
                                          atol=1e-6)))
        with open(delta.path + ".commit") as f:
            delta_tables = json.load(f)["manifest"]["tables"]
        delta_rows = sum(  # Table rows (not slots' ids) in the delta.
            shape[0] for f in sorted(n for n in delta.files if n.endswith(".index") and "/ps-" in n)
            for name, shape in tf.train.load_checkpoint(
                os.path.join(model_dir, f[:-len(".index")])).get_variable_to_shape_map().items()
            if name.endswith("/.DELTA/ids") and name[:-len("/.DELTA/ids")] in delta_tables)
        other = build(2)  # Dropped after the check: it never coexists with a full save.
        restorer = tf_psplugin.ChiefCheckpointManager(model_dir, model=other[0], optimizer=other[1])
        start = time.perf_counter()
        restored = restorer.restore()
        restore_seconds = time.perf_counter() - start
        table = model.get_layer("table").embeddings
        other_table = other[0].get_layer("table").embeddings
        mismatches = ([] if restored.path == delta.path else ["restored " + restored.path])
        mismatches += [] if equal_on_ps(table, other_table) else ["table"]
        mismatches += optimizer_mismatches((model, optimizer), other)
        mismatches += [a.name for a, b in zip(model.get_layer("out").weights,
                                               other[0].get_layer("out").weights)
                       if not equal_on_ps(a, b)]
        exact = not mismatches
        print("INCREMENTAL_RESULT " + json.dumps({
            "table_stacked": isinstance(model.get_layer("table").embeddings,
                                        tf_psplugin.tables.stacking.StackedTable),
            "optimizer_variables": len(optimizer_state(model, optimizer)),
            "rows": rows, "dim": dim, "touched_fraction": fraction, "touched_rows": touched,
            "delta_rows": int(delta_rows),
            "full_bytes": sum(full.files.values()), "delta_bytes": sum(delta.files.values()),
            "full_seconds": round(full_seconds, 3), "delta_seconds": round(delta_seconds, 3),
            "restore_seconds": round(restore_seconds, 3), "restore_exact": bool(exact),
            "restore_mismatches": mismatches,
            "peak_rss_mb": {"chief": round(peak_rss_mb(), 1),
                            "serving": answer.get("peak_rss_mb")},
            "serving_freshness_seconds": round(freshness, 3),
            "serving_exact": serving_exact,
            "serving_apply_seconds": answer["apply_seconds"],
            "serving_poll_seconds": poll_seconds,
            "export_seconds": round(export_seconds, 3),
            "serving_load_seconds": serving_load_seconds,
            "serving_reload_seconds": ready.get("apply_seconds") if n else None,
            "serving_reloaded": ready.get("applied")}), flush=True)
        del other, restorer, restored, other_table
        gc.collect()
finally:
    if serving is not None:
        serving.stop()
'''


SERVING = r'''
import json, os, sys, time
import tensorflow as tf
import tf_psplugin
from benchmarks.procs import peak_rss_mb

export_dir, model_dir, probe_path, poll_seconds = sys.argv[1:4] + [float(sys.argv[4])]
assert "TF_CONFIG" not in os.environ
start = time.perf_counter()
serving = tf_psplugin.ServingModel(export_dir, model_dir=model_dir)
print("SERVING " + json.dumps({"step": serving.step, "checkpoint": serving.checkpoint,
                               "load_seconds": round(time.perf_counter() - start, 3)}),
      flush=True)
while True:
    time.sleep(poll_seconds)
    start = time.perf_counter()
    applied = serving.poll()
    if not applied:
        continue
    apply_seconds = time.perf_counter() - start
    line = {"step": serving.step, "checkpoint": serving.checkpoint,
            "applied": [i.name for i in applied], "apply_seconds": round(apply_seconds, 3),
            "peak_rss_mb": round(peak_rss_mb(), 1)}
    if os.path.exists(probe_path):  # A request for the rows the last step touched.
        with open(probe_path) as f:
            ids = json.load(f)["ids"]
        output = serving(tf.constant([ids], tf.int64)).numpy().ravel()
        line.update(ids=ids, output=[float(x) for x in output], answered=time.time())
    print("SERVING " + json.dumps(line), flush=True)
'''


SAVES_CHIEF = r'''
import json, os, sys, time
import tensorflow as tf
import tf_psplugin
from benchmarks.procs import current_rss_mb

saves, model_dir, rows = int(sys.argv[1]), sys.argv[2], 200_000
tf_psplugin.start_server()
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Embedding(rows, 16), tf.keras.layers.Dense(1)])
    model.build((None, None))
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.1)
manager = tf_psplugin.ChiefCheckpointManager(model_dir, model=model, optimizer=optimizer,
                                             full_every_saves=10 ** 9, max_to_keep=1)


@tf.function
def train_step(start):
    def replica_fn(start):
        ids = (start + tf.range(2000, dtype=tf.int64) * 7919) % rows
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids[None, :]) - 1.0))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    strategy.run(replica_fn, args=(start,))


def step_and_save(i):
    coordinator.schedule(train_step, args=(tf.constant(i, tf.int64),))
    coordinator.join()
    return manager.save(int(optimizer.iterations.numpy()))


for i in range(30):  # Warm-up: one full save, then deltas.
    step_and_save(i)
print("SAVES_MARK " + json.dumps({"at": "warm", "time": time.time(),
                                  "chief_rss_mb": current_rss_mb(os.getpid())}), flush=True)
start = time.perf_counter()
for i in range(30, 30 + saves):
    info = step_and_save(i)
seconds = (time.perf_counter() - start) / saves
print("SAVES_MARK " + json.dumps({"at": "done", "time": time.time(),
                                  "chief_rss_mb": current_rss_mb(os.getpid()),
                                  "seconds_per_step_and_save": seconds,
                                  "kind": info.kind}), flush=True)
'''


def run_saves(saves: int, log_dir: str) -> dict:
    """`--saves N`: RSS of every process over N delta saves of a 200k x 16 table (leaks)."""
    import threading  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top

    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    script = os.path.join(log_dir, "incremental_saves_chief.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(SAVES_CHIEF)
    log = os.path.join(log_dir, "incremental_saves.log")
    model_dir = tempfile.mkdtemp(prefix="tf_psplugin_incremental_saves_")
    samples, done = [], threading.Event()
    try:
        with open(log, "w", encoding="utf-8") as out:
            with LocalCluster(num_workers=1, num_ps=2, servers="builtin",
                              env=procs.child_env(), output=out, grace_period=2.0) as cluster:
                cluster.start_servers()
                procs.wait_until_serving(cluster, 3, log)
                servers = {r: p for r, p in cluster.pids().items() if r != "chief"}

                def poll():
                    while not done.is_set():
                        samples.append((time.time(), {r: procs.current_rss_mb(p)
                                                      for r, p in servers.items()}))
                        time.sleep(0.25)

                thread = threading.Thread(target=poll, daemon=True)
                thread.start()
                try:
                    result = cluster.run_chief([sys.executable, script, str(saves), model_dir],
                                               timeout=1800)
                finally:
                    done.set()
                    thread.join()
                text = "".join(cluster.output("chief"))
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    marks = {}
    for line in text.splitlines():
        if "SAVES_MARK " in line:
            mark = json.loads(line.split("SAVES_MARK ", 1)[1])
            marks[mark["at"]] = mark
    if result.returncode != 0 or set(marks) != {"warm", "done"}:
        raise procs.BenchmarkProcessError(f"chief exited {result.returncode}; log {log}")

    def rss_at(when):
        return min(samples, key=lambda s: abs(s[0] - when))[1]

    before, after = rss_at(marks["warm"]["time"]), rss_at(marks["done"]["time"])
    before["chief"], after["chief"] = marks["warm"]["chief_rss_mb"], marks["done"]["chief_rss_mb"]
    return {"kind": "incremental_saves", "saves": saves, "rows": 200_000, "dim": 16,
            "last_kind": marks["done"]["kind"],
            "seconds_per_step_and_save": round(marks["done"]["seconds_per_step_and_save"], 4),
            "rss_mb_after_warmup": {r: round(v, 1) for r, v in sorted(before.items())},
            "rss_mb_per_100_saves": {r: round((after[r] - before[r]) * 100 / saves, 2)
                                     for r in sorted(before)}}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.incremental",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="table rows")
    p.add_argument("--dim", type=int, default=16, help="table width (float32)")
    p.add_argument("--fractions", default="0.01,0.1,0.01",
                   help="comma-separated fractions of rows one step touches (the summary "
                        "takes the last run of the smallest: warm saves)")
    p.add_argument("--quick", action="store_true",
                   help="the issue's run: 10M x 16 at 1%%, 10%% and 1%% again (the defaults)")
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--chart", default="", help="PNG of bytes and seconds, full vs delta")
    p.add_argument("--log_dir", default=None)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--serving_poll_seconds", type=float, default=0.5,
                   help="how often the serving process polls the model directory")
    p.add_argument("--optimizer", default="legacy.Adagrad", choices=sorted(OPTIMIZERS),
                   help="the table's optimizer: " + "; ".join(
                       f"{k}: {v}" for k, v in sorted(OPTIMIZERS.items())))
    p.add_argument("--stack_tables", default="true", choices=("true", "false"),
                   help="the strategy's stack_tables (the 10M-row table is too large to "
                        "stack either way; recorded with table_stacked)")
    p.add_argument("--saves", type=int, default=0,
                   help="instead: RSS of every process over this many delta saves (leaks)")
    args = p.parse_args(argv)
    args.stack_tables = args.stack_tables == "true"
    args.fraction_list = [float(x) for x in args.fractions.split(",") if x]
    if not args.fraction_list or not all(0 < f <= 1 for f in args.fraction_list):
        p.error("--fractions must be in (0, 1]")
    if args.serving_poll_seconds <= 0:
        p.error("--serving_poll_seconds must be > 0")
    if args.rows < 100 or args.dim < 1 or args.rows % 7919 == 0:
        p.error("--rows must be >= 100 and not a multiple of 7919, --dim >= 1")
    return args


def run_options(args: argparse.Namespace) -> dict:
    """Every option of a run, as each of its JSON lines records them."""
    return {"num_ps": 2, "workers": 1, "optimizer": args.optimizer,
            "optimizer_class": OPTIMIZERS[args.optimizer], "stack_tables": args.stack_tables,
            "full_every": FULL_EVERY, "max_to_keep": 1, "serving_poll_seconds":
            args.serving_poll_seconds, "fractions": args.fraction_list}


def write_chart(records: List[dict], path: str) -> str:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    labels = [f"{r['touched_fraction']:.0%} touched" for r in records]
    xs = range(len(records))
    for ax, field, unit, scale in ((axes[0], "bytes", "MB", 1e6), (axes[1], "seconds", "s", 1)):
        full = [r[f"full_{field}"] / scale for r in records]
        delta = [r[f"delta_{field}"] / scale for r in records]
        ax.bar([x - 0.2 for x in xs], full, width=0.4, label="full save")
        ax.bar([x + 0.2 for x in xs], delta, width=0.4, label="delta")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels)
        ax.set(ylabel=f"{field} ({unit})", title=field)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    rows = records[0]["rows"] if records else 0
    optimizer = records[0].get("optimizer", "legacy.Adagrad") if records else ""
    fig.suptitle(f"Incremental checkpoints: {rows:,} x {records[0]['dim'] if records else 0} "
                 f"table + {optimizer}, 2 PS")
    return procs.save_chart(fig, plt, path)


def summary(records: List[dict]) -> dict:
    """The targets at the smallest fraction (1% by default), exactness and freshness everywhere.

    When the smallest fraction was run more than once, its last run counts:
    the run's first full save and first delta also trace their save
    functions, so a later pair compares the warm costs a job pays at every
    save (the default fractions, 1%, 10%, 1%, end with that pair).
    """
    smallest = min(r["touched_fraction"] for r in records)
    low = [r for r in records if r["touched_fraction"] == smallest][-1]
    freshness = max(r["serving_freshness_seconds"] for r in records)
    bytes_ratio = low["delta_bytes"] / low["full_bytes"]
    seconds_ratio = low["delta_seconds"] / low["full_seconds"]
    return {"kind": "incremental_summary", "at_fraction": low["touched_fraction"],
            "delta_to_full_bytes": round(bytes_ratio, 4),
            "delta_to_full_seconds": round(seconds_ratio, 4),
            "bytes_target_met": bytes_ratio <= TARGET_BYTES_RATIO,
            "seconds_target_met": seconds_ratio <= TARGET_SECONDS_RATIO,
            "restore_exact": all(r["restore_exact"] for r in records),
            "serving_freshness_seconds": freshness,
            "freshness_target_met": freshness <= TARGET_FRESHNESS_SECONDS,
            "serving_exact": all(r["serving_exact"] for r in records)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    args = parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tf_psplugin_incremental_")
    os.makedirs(log_dir, exist_ok=True)
    if args.saves:
        procs.json_lines_emitter(args.output)(run_saves(args.saves, log_dir))
        return 0
    model_dir = tempfile.mkdtemp(prefix="tf_psplugin_incremental_ckpt_")
    serving_dir = tempfile.mkdtemp(prefix="tf_psplugin_incremental_serving_")
    emit = procs.json_lines_emitter(args.output)
    records = []
    try:
        script = os.path.join(log_dir, "incremental_chief.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(CHIEF)
        serving_script = os.path.join(log_dir, "incremental_serving.py")
        with open(serving_script, "w", encoding="utf-8") as f:
            f.write(SERVING)
        log = os.path.join(log_dir, "incremental.log")
        with open(log, "w", encoding="utf-8") as out:
            with LocalCluster(num_workers=1, num_ps=2, servers="builtin",
                              env=procs.child_env(), output=out, grace_period=2.0) as cluster:
                cluster.start_servers()
                procs.wait_until_serving(cluster, 3, log)
                servers = {role: pid for role, pid in cluster.pids().items()
                            if role != "chief"}
                result = cluster.run_chief(
                    [sys.executable, script, str(args.rows), str(args.dim),
                     json.dumps(args.fraction_list), model_dir, serving_script,
                     os.path.join(serving_dir, "export"), str(args.serving_poll_seconds),
                     args.optimizer, str(args.stack_tables).lower(), str(FULL_EVERY)],
                    timeout=args.timeout)
                text = "".join(cluster.output("chief"))
                peaks = {role: round(procs.peak_rss_mb(str(pid)), 1)
                         for role, pid in servers.items()}
        if result.returncode != 0 or RESULT_PREFIX not in text:
            raise procs.BenchmarkProcessError(f"chief exited {result.returncode}; log {log}")
        for line in text.splitlines():
            if RESULT_PREFIX in line:
                record = {"kind": "incremental", **run_options(args),
                          **json.loads(line.split(RESULT_PREFIX, 1)[1])}
                record["peak_rss_mb"].update(peaks)
                records.append(record)
                emit(record)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(serving_dir, ignore_errors=True)
    emit({**summary(records), **run_options(args)})
    if args.chart:
        print(f"chart: {write_chart(records, args.chart)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
