"""The smallest tf_psplugin Keras job: only the `# tf_psplugin:` lines are new.

Local cluster:  python -m tf_psplugin.launch --workers 2 --ps 1 -- python keras_examples/minimal.py
By hand, one process per task (same command everywhere, first worker = chief):
    python keras_examples/minimal.py --job_name=worker --task_index=0 \
        --worker_hosts=localhost:2220,localhost:2221,localhost:2222 --ps_hosts=localhost:2230
or with TF_CONFIG set and no flags. See keras_examples/README.md.
"""
import numpy as np
import tensorflow as tf

import tf_psplugin  # tf_psplugin: raises a clear ImportError under Keras 3.


def main():
    tf_psplugin.start_server()  # tf_psplugin: ps/worker tasks serve here and never return.
    strategy = tf_psplugin.HybridParameterServerStrategy()  # tf_psplugin: chief = coordinator.
    with strategy.scope():  # tf_psplugin: the strategy places what is created here.
        model = tf.keras.Sequential([
            tf.keras.layers.Embedding(10_000, 8),  # Table: sharded over the PS tasks.
            tf.keras.layers.GlobalAveragePooling1D(),
            tf.keras.layers.Dense(1),  # Dense: one replica per worker, gradients all-reduced.
        ])
        # tf_psplugin: a Keras 2 legacy optimizer (the strategy supports these).
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), loss="mse")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 10_000, size=(4096, 4))
    labels = (ids % 2).mean(axis=1, keepdims=True).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(32)
    # tf_psplugin: each step runs on every worker, each on its own batches.
    history = model.fit(dataset, epochs=2, steps_per_epoch=10)
    print(f"minimal: done, final loss {history.history['loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
