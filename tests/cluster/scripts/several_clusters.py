"""One process, several clusters one after another: each gets a strategy and trains.

What a notebook or a test suite does (issue 18, item 4). Each cluster is a
fresh `LocalCluster` (new servers, new ports), stopped before the next one
starts; the process builds a `HybridParameterServerStrategy` against each and
fits a small model. Prints one JSON line per cluster, then "done". A crash
(the segfault in `variables._create_replica` the issue reported) shows as a
negative exit code in the test.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from tf_psplugin.launch import LocalCluster


def fit(strategy, seed):
    rng = np.random.default_rng(seed)
    with strategy.scope():
        inp = tf.keras.Input((4,), dtype="int64")
        x = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(100, 4)(inp))
        model = tf.keras.Model(inp, tf.keras.layers.Dense(1)(x))
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
    ids, y = rng.integers(0, 100, (256, 4)), rng.random((256, 1)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(32, drop_remainder=True).repeat()
    history = model.fit(ds, steps_per_epoch=5, verbose=0)
    tables = [r for r in strategy.placement_records() if r.kind == "table"]
    return history.history["loss"][-1], tables[0].devices


def main():
    count = int(sys.argv[1])
    with open(os.devnull, "w") as devnull:
        for i in range(count):
            cluster = LocalCluster(2, 2, servers="builtin", output=devnull)
            try:
                cluster.start_servers()
                strategy = tf_psplugin.HybridParameterServerStrategy(config=cluster.config)
                loss, devices = fit(strategy, seed=i)
                print(json.dumps({"cluster": i, "loss": float(loss), "ports": sorted(
                    int(a.rsplit(":", 1)[1]) for a in cluster.config.cluster["worker"]),
                    "table_devices": list(devices)}), flush=True)
            finally:
                cluster.stop()
    print("done", flush=True)


if __name__ == "__main__":
    main()
