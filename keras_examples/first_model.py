"""README's first model, verbatim: a table on the PS tasks, dense layers on the workers.

python -m tf_psplugin.launch --workers 2 --ps 1 -- python keras_examples/first_model.py
Run it again: it restores the checkpoint in $MODEL_DIR (default /tmp/first_model) and goes on.
tests/unit/test_doc_examples.py checks that README.md shows this file's code (below the docstring).
"""
import os

import numpy as np
import tensorflow as tf

import tf_psplugin  # tf_psplugin: raises a clear ImportError under Keras 3.

tf_psplugin.start_server()  # tf_psplugin: ps/worker tasks serve here and never return.
strategy = tf_psplugin.HybridParameterServerStrategy()  # tf_psplugin: chief = coordinator.
with strategy.scope():  # tf_psplugin: the strategy places what is made here.
    model = tf.keras.Sequential([
        tf.keras.layers.Embedding(10_000, 8),  # A table: sharded over the PS tasks.
        tf.keras.layers.GlobalAveragePooling1D(),
        tf.keras.layers.Dense(1),  # Dense: one replica per worker, gradients all-reduced.
    ])
    model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), loss="mse")

ids = np.random.default_rng(0).integers(0, 10_000, size=(4096, 4))
labels = (ids % 2).mean(axis=1, keepdims=True).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(32)

model_dir = os.environ.get("MODEL_DIR", "/tmp/first_model")
model.fit(dataset, epochs=2, steps_per_epoch=10,  # Each step runs on every worker.
          # tf_psplugin: restores the latest checkpoint first, saves at the end.
          callbacks=[tf_psplugin.ChiefCheckpoint(model_dir)])
print("first_model: done at step", int(model.optimizer.iterations.numpy()))
