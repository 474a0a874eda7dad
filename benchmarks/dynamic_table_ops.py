"""`python -m benchmarks.dynamic_table_ops`: key-to-row maps on a PS, per call.

Why this module exists: issue 15 (dynamic embedding tables keyed by raw
ids) asks to choose the mechanism by measurement, with pure TF ops only. A
dynamic table needs a key -> row map on each PS next to the rows; this
times one step's worth of Zipf raw keys (any int64) through each candidate,
against a static table's gather of the same number of rows, all run on one
PS task from the chief (each call one remote function call, as a worker's
step would make):

* ``static_gather``: ``gather(rows, key mod capacity)``: today's hashed table.
* ``mht_lookup_only`` / ``dht_lookup_only``: `MutableHashTable` /
  `DenseHashTable` lookup of every key, then the gather (rows of unknown
  keys read zeros).
* ``mht_insert_lookup`` / ``dht_insert_lookup``: the same after inserting
  the batch's unknown keys (unique, lookup, insert with slots from a
  counter, inside a `tf.CriticalSection` as concurrent workers would need).

Prints one JSON line per mechanism (milliseconds per call, median of the
repeats, and the ratio to ``static_gather``) and one summary line, which
also checks that a PS-resident table survives a checkpoint round trip.
``--local`` runs everything in this process instead (no cluster; what the
unit test uses).
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

MECHANISMS = ("static_gather", "mht_lookup_only", "mht_insert_lookup",
              "dht_lookup_only", "dht_insert_lookup")
_CHILD_ENV = "TF_PSPLUGIN_DYNAMIC_OPS_ARGS"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dynamic_table_ops",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys_per_call", type=int, default=26 * 512,
                   help="keys per call (default: 26 features x a 512-example worker batch)")
    p.add_argument("--capacity", type=int, default=1_000_000, help="rows of the table")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--distinct", type=int, default=2_000_000,
                   help="distinct raw keys the Zipf stream draws from")
    p.add_argument("--batches", type=int, default=64, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--local", action="store_true", help="no cluster: run on this process's CPU")
    p.add_argument("--timeout", type=float, default=900.0)
    return p


def measure(args, device: str, checkpoint_dir: str) -> list:
    """Times every mechanism on `device`; returns the JSON records."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    rng = np.random.default_rng(0)
    pool = rng.integers(-2**62, 2**62, size=args.distinct, dtype=np.int64)
    cap = args.capacity
    with tf.device(device):
        rows = tf.Variable(tf.zeros([cap, args.dim]))
        next_slot = tf.Variable(0, dtype=tf.int64)
        tables = {
            "mht": tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default_value=-1),
            # DenseHashTable reserves two key values (empty, deleted): a real
            # table would have to route those two raw keys elsewhere.
            "dht": tf.lookup.experimental.DenseHashTable(
                tf.int64, tf.int64, default_value=-1, empty_key=np.iinfo(np.int64).max,
                deleted_key=np.iinfo(np.int64).max - 1),
        }
        section = tf.CriticalSection(name="slot_allocation")

    def read(table, keys):
        slots = tf.reshape(table.lookup(keys), [-1])
        got = tf.gather(rows, tf.maximum(slots, 0))
        return tf.reduce_sum(tf.where(slots[:, None] >= 0, got, 0.0))

    def insert_missing(table, keys):
        unique, _ = tf.unique(tf.reshape(keys, [-1]))
        missing = tf.boolean_mask(unique, tf.reshape(table.lookup(unique), [-1]) < 0)
        n = tf.size(missing, out_type=tf.int64)
        start = next_slot.assign_add(n) - n
        with tf.control_dependencies([table.insert(missing, (start + tf.range(n)) % cap)]):
            return tf.identity(n)

    def on_device(body):
        def fn(keys):
            with tf.device(device):
                return body(keys)
        return tf.function(fn)

    def with_insert(table):
        def body(keys):
            n = section.execute(lambda: insert_missing(table, keys))
            with tf.control_dependencies([n]):
                return read(table, keys)
        return body

    fns = {
        "static_gather": on_device(
            lambda keys: tf.reduce_sum(tf.gather(rows, tf.math.floormod(keys, cap)))),
        "mht_lookup_only": on_device(lambda keys: read(tables["mht"], keys)),
        "mht_insert_lookup": on_device(with_insert(tables["mht"])),
        "dht_lookup_only": on_device(lambda keys: read(tables["dht"], keys)),
        "dht_insert_lookup": on_device(with_insert(tables["dht"])),
    }
    batches = [tf.constant(pool[np.minimum(rng.zipf(1.2, args.keys_per_call) - 1,
                                           args.distinct - 1)])
               for _ in range(args.batches)]
    for fn in fns.values():  # Trace, warm up, and fill the maps with the stream's keys.
        for b in batches:
            fn(b).numpy()
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():  # Interleaved, so drift hits every mechanism alike.
            start = time.perf_counter()
            for b in batches:
                fn(b).numpy()
            times[name].append((time.perf_counter() - start) / len(batches) * 1e3)
    base = float(np.median(times["static_gather"]))
    records = []
    for name in MECHANISMS:
        ms = float(np.median(times[name]))
        records.append({"mode": "dynamic_table_ops", "mechanism": name,
                        "ms_per_call": round(ms, 3), "runs_ms": [round(t, 3) for t in times[name]],
                        "ratio_to_static_gather": round(ms / base, 3),
                        "keys_per_call": args.keys_per_call, "device": device})
    path = tf.train.Checkpoint(mht=tables["mht"]).write(os.path.join(checkpoint_dir, "t"))
    with tf.device(device):
        restored = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default_value=-1)
    tf.train.Checkpoint(mht=restored).read(path).expect_partial()
    records.append({"mode": "dynamic_table_ops_summary", "keys_stored": int(tables["mht"].size()),
                    "keys_restored_from_checkpoint": int(restored.size()),
                    "dht_keys_stored": int(tables["dht"].size()), "device": device,
                    "tf_version": tf.__version__})
    return records


def _chief(args) -> int:
    """The chief of the benchmark's cluster: connect, measure on ps:0, print."""
    import tf_psplugin  # pylint: disable=g-import-not-at-top

    tf_psplugin.start_server()  # The ps/worker tasks serve here.
    tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(log_placement=False))  # Connects the cluster.
    with tempfile.TemporaryDirectory() as tmp:
        for record in measure(args, "/job:ps/replica:0/task:0/device:CPU:0", tmp):
            sys.stdout.write("RECORD " + json.dumps(record) + "\n")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if os.environ.get(_CHILD_ENV):
        return _chief(args)
    if args.local:
        with tempfile.TemporaryDirectory() as tmp:
            records = measure(args, "/CPU:0", tmp)
    else:
        from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        with LocalCluster(num_workers=1, num_ps=1, output=sys.stderr,
                          env={_CHILD_ENV: "1", "PYTHONPATH": path}) as cluster:
            cluster.start_servers()
            result = cluster.run_chief([sys.executable, "-m", "benchmarks.dynamic_table_ops"]
                                       + argv, timeout=args.timeout)
        records = [json.loads(line.split("RECORD ", 1)[1])
                   for line in result.stdout.splitlines() if "RECORD " in line]
        if result.returncode != 0 or not records:
            sys.stderr.write(result.stdout[-4000:] + "\n")
            return 1
    for record in records:
        sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
