"""Chief script: train with an embedding table of ROWS x 16 (argv[2]) for 20 steps.

The table and its Adagrad slots live on the PS tasks; the test compares the
workers' peak memory across table sizes.
"""

import json
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin

OUT, ROWS = sys.argv[1], int(sys.argv[2])


def main():
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, size=(4096, 4)).astype("int64")
    y = rng.random((4096, 1)).astype("float32")
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((4,), dtype="int64"), tf.keras.layers.Embedding(ROWS, 16),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.05), "mse")
    hist = model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(64).repeat(),
                     epochs=1, steps_per_epoch=20, verbose=0)
    with open(OUT, "w") as f:
        json.dump({"loss": hist.history["loss"][0],
                   "table_bytes": ROWS * 16 * 4,
                   "records": [r.to_dict() for r in strategy.placement_records()]}, f)
    print("RESULT ok", flush=True)


if __name__ == "__main__":
    main()
