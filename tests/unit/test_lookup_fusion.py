"""Automatic lookup fusion (`tables/fusion.py`) in one process.

The strategy is stood in for by patching `fusion.fuse_all`, and each
Embedding's table is swapped for an `InterleavedShardedVariable` of the same
value, as the strategy would create it. The cluster check is the sync
equivalence test (tests/cluster/test_strategy.py), whose model's two tables
are fused by default.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin.tables import fusion
from tf_psplugin.tables import prefetched
from tf_psplugin.tables.sharded import InterleavedShardedVariable

FEATURES, VOCAB = 4, 20


def _model(num_shards=2):
    """Four int64 features: three 4-wide tables, one 8-wide; a float-id table."""
    tf.keras.utils.set_random_seed(0)
    ids = tf.keras.Input((FEATURES,), dtype="int64")
    float_ids = tf.keras.Input((1,), dtype="float32")
    columns = []
    for f in range(FEATURES):
        col = tf.keras.layers.Lambda(lambda t, f=f: t[:, f], name=f"ids_{f}")(ids)
        columns.append(tf.keras.layers.Embedding(VOCAB, 8 if f == 3 else 4, name=f"emb_{f}")(col))
    columns.append(tf.keras.layers.Flatten()(
        tf.keras.layers.Embedding(VOCAB, 4, name="emb_float")(float_ids)))
    x = tf.keras.layers.Concatenate()(columns)
    model = tf.keras.Model([ids, float_ids], tf.keras.layers.Dense(1, name="out")(x))
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Embedding):
            full = layer.embeddings.numpy()
            layer.embeddings = InterleavedShardedVariable(
                [tf.Variable(full[s::num_shards]) for s in range(num_shards)],
                name=layer.name)
    return model


def _variables(model):
    out = []
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Embedding):
            out.extend(layer.embeddings.variables)
        else:
            out.extend(layer.trainable_weights)
    return out


def _run(model, fuse, monkeypatch):
    monkeypatch.setattr(fusion, "fuse_all", lambda: fuse)
    rng = np.random.default_rng(1)
    ids = tf.constant(rng.integers(0, VOCAB, size=(6, FEATURES)), tf.int64)
    float_ids = tf.constant(rng.integers(0, VOCAB, size=(6, 1)).astype("float32"))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model([ids, float_ids]) ** 2)
        grads = tape.gradient(loss, _variables(model))
        return loss, [tf.convert_to_tensor(g) for g in grads]

    graph = step.get_concrete_function().graph
    loss, grads = step()
    fused = [op for op in graph.get_operations()
             if "fused_lookups" in op.name and op.type == "ResourceGather"]
    return float(loss), [g.numpy() for g in grads], fused


def test_fused_run_equals_per_layer_lookups(monkeypatch):
    patches.install("keras_functional_fusion")
    model = _model()
    loss, grads, fused = _run(model, True, monkeypatch)
    ref_loss, ref_grads, ref_fused = _run(model, False, monkeypatch)
    # The three 4-wide int64 tables, 2 shards each; the 8-wide table (alone
    # in its group) and the float-id table (cast by Embedding.call) are not.
    assert len(fused) == 6, [op.name for op in fused]
    assert not ref_fused
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
    assert sum(np.abs(g).sum() for g in grads[:6]) > 0  # The tables get gradients.


def test_no_fusion_outside_the_strategy_or_eagerly(monkeypatch):
    patches.install("keras_functional_fusion")
    model = _model()
    _, _, fused = _run(model, False, monkeypatch)
    assert not fused
    monkeypatch.setattr(fusion, "fuse_all", lambda: True)
    out = model([tf.zeros((2, FEATURES), tf.int64), tf.zeros((2, 1))])  # Eager: per layer.
    assert out.shape == (2, 1)
    assert not prefetched.runs()


def test_the_same_model_twice_in_one_function_fuses_each_call(monkeypatch):
    patches.install("keras_functional_fusion")
    monkeypatch.setattr(fusion, "fuse_all", lambda: True)
    model = _model()
    a = tf.constant([[1, 2, 3, 4]], tf.int64)
    b = tf.constant([[5, 6, 7, 8]], tf.int64)
    f = tf.constant([[0.0]])

    @tf.function
    def twice():
        return model([a, f]), model([b, f])

    ya, yb = twice()
    graph = twice.get_concrete_function().graph
    fused = [op for op in graph.get_operations()
             if "fused_lookups" in op.name and op.type == "ResourceGather"]
    assert len(fused) == 12
    monkeypatch.setattr(fusion, "fuse_all", lambda: False)
    np.testing.assert_allclose(ya.numpy(), model([a, f]).numpy(), rtol=1e-6)
    np.testing.assert_allclose(yb.numpy(), model([b, f]).numpy(), rtol=1e-6)
