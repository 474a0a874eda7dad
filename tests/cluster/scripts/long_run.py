"""A long synchronous job on a small model: thousands of steps, nothing else.

Used by tests/cluster/test_long_run.py, which samples every task's threads
while this runs. Prints `STEP <n>` as steps pass and `DONE <n>` at the end.

Usage: long_run.py TOTAL_STEPS [STEPS_PER_EXECUTION]  (TOTAL_STEPS: a multiple of 100)
"""

import sys

import numpy as np
import tensorflow as tf

import tf_psplugin

STEPS_PER_EPOCH = 100


def main(argv):
    total = int(argv[1])
    spe = int(argv[2]) if len(argv) > 2 else 10
    tf_psplugin.start_server()  # ps/worker tasks block here.
    strategy = tf_psplugin.HybridParameterServerStrategy()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(4096, 4)).astype("int64")
    labels = (ids.sum(axis=1, keepdims=True) % 2).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(32).repeat()
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((4,), dtype="int64"),
            tf.keras.layers.Embedding(1000, 8),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dense(1),
        ])
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.05), "mse",
                      steps_per_execution=spe)

    class Progress(tf.keras.callbacks.Callback):
        # Keras allows only epoch-level callbacks under ParameterServerStrategy.
        def on_epoch_end(self, epoch, logs=None):
            print(f"STEP {(epoch + 1) * STEPS_PER_EPOCH}", flush=True)

    print("STEP 0", flush=True)
    model.fit(dataset, epochs=total // STEPS_PER_EPOCH, steps_per_epoch=STEPS_PER_EPOCH,
              verbose=0, callbacks=[Progress()])
    print(f"DONE {total}", flush=True)


if __name__ == "__main__":
    main(sys.argv)
