"""Chief script: model.fit / evaluate / predict variants under the hybrid strategy.

Writes a JSON report to argv[1] with one entry per variant: "ok" or the error.
"""

import json
import os
import sys
import traceback

import numpy as np
import tensorflow as tf

import tf_psplugin

OUT, WORKDIR = sys.argv[1], sys.argv[2]
VOCAB, DIM = 200, 8


def make_model():
    inp = tf.keras.Input((4,), dtype="int64")
    x = tf.keras.layers.Embedding(VOCAB, DIM)(inp)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(16, activation="relu")(x)
    x = tf.keras.layers.BatchNormalization()(x)
    out = tf.keras.layers.Dense(1, activation="sigmoid")(x)
    return tf.keras.Model(inp, out)


def data(n=4096, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(n, 4)).astype("int64")
    y = (ids[:, :1] % 2).astype("float32")
    return ids, y


def main():
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy()
    results = {}
    ids, y = data()
    vids, vy = data(1024, seed=1)

    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((ids, y)).repeat()
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(input_context.get_per_replica_batch_size(64)).prefetch(2)

    def variant(name, fn):
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - the report lists every failure.
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                             "traceback": traceback.format_exc()[-3000:]}

    with strategy.scope():
        model = make_model()
        model.compile(tf.keras.optimizers.legacy.Adam(0.01), "binary_crossentropy",
                      metrics=["accuracy", tf.keras.metrics.AUC(name="auc")],
                      steps_per_execution=1)

    def plain_dataset():
        ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(32).repeat()
        h = model.fit(ds, epochs=2, steps_per_epoch=10, verbose=2,
                      validation_data=tf.data.Dataset.from_tensor_slices((vids, vy)).batch(64),
                      validation_steps=4)
        return {k: [float(x) for x in v] for k, v in h.history.items()}

    def with_dataset_creator():
        h = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                      steps_per_epoch=10, verbose=2)
        return {k: [float(x) for x in v] for k, v in h.history.items()}

    def with_callbacks():
        ckpt_dir = os.path.join(WORKDIR, "ckpt")
        backup_dir = os.path.join(WORKDIR, "backup")
        tb_dir = os.path.join(WORKDIR, "tb")
        cbs = [
            tf.keras.callbacks.ModelCheckpoint(os.path.join(ckpt_dir, "w-{epoch}"),
                                               save_weights_only=True),
            tf.keras.callbacks.BackupAndRestore(backup_dir),
            tf.keras.callbacks.TensorBoard(tb_dir, update_freq=5),
            tf.keras.callbacks.EarlyStopping(monitor="loss", patience=5),
        ]
        ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(32).repeat()
        h = model.fit(ds, epochs=2, steps_per_epoch=8, callbacks=cbs, verbose=0)
        return {"epochs": len(h.history["loss"]),
                "ckpt_files": sorted(os.listdir(ckpt_dir)),
                "tb_files": sum(len(f) for _, _, f in os.walk(tb_dir))}

    def with_steps_per_execution():
        with strategy.scope():
            m = make_model()
            m.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "binary_crossentropy",
                      steps_per_execution=5)
        ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(32).repeat()
        h = m.fit(ds, epochs=1, steps_per_epoch=20, verbose=0)
        return {"loss": float(h.history["loss"][0]),
                "iterations": int(m.optimizer.iterations.numpy())}

    def evaluate():
        ev = model.evaluate(tf.data.Dataset.from_tensor_slices((vids, vy)).batch(64),
                            steps=8, return_dict=True, verbose=0)
        return {k: float(v) for k, v in ev.items()}

    def predict():
        p = model.predict(vids[:100], verbose=0)
        return {"shape": list(p.shape), "finite": bool(np.isfinite(p).all())}

    def verbose_1():
        """Keras refuses verbose=1 under stock PSS; here it is the plugin's ProgressBar."""
        import contextlib
        import io

        text = io.StringIO()
        ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(32, drop_remainder=True).repeat()
        with contextlib.redirect_stdout(text):
            model.fit(ds, epochs=1, steps_per_epoch=12, verbose=1)
            model.evaluate(tf.data.Dataset.from_tensor_slices((vids, vy)).batch(64),
                           steps=4, verbose=1)
        return {"output": text.getvalue()}

    def batch_norm_replicas():
        """BatchNormalization's moving statistics (ON_READ, MEAN) stay identical on every worker."""
        bn = next(l for l in model.layers if isinstance(l, tf.keras.layers.BatchNormalization))
        out = {}
        for v in (bn.moving_mean, bn.moving_variance):
            values = [r.numpy() for r in v.replica_values()]
            out[v.name] = {"identical": all(np.array_equal(values[0], x) for x in values[1:]),
                           "moved": bool(np.any(values[0] != (0.0 if "mean" in v.name else 1.0)))}
        return out

    def unread_metric_update():
        """A custom step that updates a metric after its gradients and never reads it."""

        class Custom(tf.keras.Model):
            def train_step(self, data):
                x, y_true = data
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(self(x, training=True) - y_true))
                self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
                # Never read in the step: written at its end (on_read_updates.py).
                self.seen.update_state(tf.cast(tf.shape(x)[0], tf.float32))
                return {}

        with strategy.scope():
            inner = make_model()
            m = Custom(inner.inputs, inner.outputs)
            m.seen = tf.keras.metrics.Sum(name="seen")
            m.compile(tf.keras.optimizers.legacy.SGD(0.1))
        ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(32).repeat()
        seen = []
        for _ in range(2):  # the second fit finds the traced step cached
            m.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
            seen.append(float(m.seen.result()))
        return {"seen": seen}

    variant("plain_dataset", plain_dataset)
    variant("batch_norm_replicas", batch_norm_replicas)
    variant("unread_metric_update", unread_metric_update)
    variant("verbose_1", verbose_1)
    variant("dataset_creator", with_dataset_creator)
    variant("callbacks", with_callbacks)
    variant("steps_per_execution", with_steps_per_execution)
    variant("evaluate", evaluate)
    variant("predict", predict)
    with open(OUT, "w") as f:
        json.dump(results, f, indent=1)
    print("RESULT ok")


if __name__ == "__main__":
    main()
