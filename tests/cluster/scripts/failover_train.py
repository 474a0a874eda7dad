"""Chief script for failover tests: deterministic training that can resume.

argv: OUT_JSON MODEL_DIR TOTAL_STEPS CKPT_EVERY. Uses a plain
tf.train.CheckpointManager registered with tf_psplugin.fault.failover, so the test
exercises the failover machinery itself. Prints "STEP <n>" every step.
"""

import json
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from tf_psplugin.fault import failover
from tf_psplugin.state import checkpoint as checkpoint_lib

OUT, MODEL_DIR, TOTAL, EVERY = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
VOCAB, DIM, BATCH = 64, 4, 16


def make_model():
    inp = tf.keras.Input((3,), dtype="int64")
    x = tf.keras.layers.Embedding(
        VOCAB, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1))(inp)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(16, activation="relu",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)
    out = tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))(x)
    return tf.keras.Model(inp, out)


class Checkpointer(tf.keras.callbacks.Callback):
    """Periodic saves plus the emergency save failover asks for."""

    def __init__(self, manager, optimizer):
        super().__init__()
        # Keras allows batch-level callbacks under PSS only if they accept
        # RemoteValue logs (this one ignores logs).
        self._supports_tf_logs = True
        self.manager, self.optimizer = manager, optimizer

    def _step(self):
        return int(self.optimizer.iterations.numpy())

    def save_emergency(self):
        return self.manager.save(checkpoint_number=self._step())

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        print(f"STEP {step}", flush=True)
        if step % EVERY == 0:
            self.manager.save(checkpoint_number=step)


def main():
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(collective_timeout_seconds=30),
        failover=failover.FailoverPolicy(recovery_timeout_seconds=120))
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(TOTAL * n * BATCH, 3)).astype("int64")
    y = rng.normal(size=(TOTAL * n * BATCH, 1)).astype("float32")
    with strategy.scope():
        model = make_model()
        optimizer = tf.keras.optimizers.legacy.SGD(0.05)
        model.compile(optimizer, "mse")
    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(ckpt, MODEL_DIR, max_to_keep=5)
    start = 0
    if manager.latest_checkpoint:
        ckpt.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        start = int(optimizer.iterations.numpy())
        print(f"RESUMED {start} from {manager.latest_checkpoint}", flush=True)
    cb = Checkpointer(manager, optimizer)
    checkpoint_lib.register_checkpointer(cb)
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH).skip(start * n)
    if TOTAL > start:
        model.fit(ds, epochs=1, steps_per_epoch=TOTAL - start, callbacks=[cb], verbose=0)
    manager.save(checkpoint_number=int(optimizer.iterations.numpy()))
    weights = [tf.convert_to_tensor(model.layers[1].embeddings).numpy().tolist()] + [
        w.numpy().tolist() for layer in model.layers[2:] for w in layer.weights]
    with open(OUT, "w") as f:
        json.dump({"iterations": int(optimizer.iterations.numpy()),
                   "restarts": failover.restarts_so_far(), "start": start,
                   "weights": weights}, f)
    print("RESULT ok", flush=True)


if __name__ == "__main__":
    main()
