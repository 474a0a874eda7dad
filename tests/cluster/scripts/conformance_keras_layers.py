"""Keras layer arguments and model APIs, as a Keras user writes them, with the default strategy.

Used by tests/cluster/test_conformance.py. Every point here holds in one
process and under stock ParameterServerStrategy; the strategy is
``HybridParameterServerStrategy()`` (its default stacks the tables: issues
29 and 40, table stacking that Keras cannot tell apart), or with the
argument ``unstacked``
``HybridParameterServerStrategy(options=HybridOptions(stack_tables=False))``.
Each check prints `CHECK <name> ok` or `CHECK <name> FAIL <why>`, and the script ends with
`DONE`. The tables are small `Embedding` layers of one width (what table
stacking would put in one variable), in a functional model and in a second
model built in the same scope, trained with `model.fit`.
"""


import sys
import traceback

import numpy as np
import tensorflow as tf

import tf_psplugin
from checks import check  # tests/cluster/scripts/checks.py

V_A, V_FROZEN, V_REG, V_CON = 30, 30, 20, 24
DIM = 4


def attempt(name, fn):
    """Runs `fn`; an exception fails `name`."""
    try:
        fn()
    except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()  # The whole story on stderr; the CHECK line has its start.
        check(name, False, f"{type(e).__name__}: {e}")


def build_model(prefix):
    ids = tf.keras.Input((4,), dtype="int64", name=f"{prefix}_ids")
    a = tf.keras.layers.Embedding(V_A, DIM, name=f"{prefix}_item_embedding")(ids[:, 0])
    frozen = tf.keras.layers.Embedding(V_FROZEN, DIM, trainable=False,
                                       name=f"{prefix}_frozen_embedding")(ids[:, 1])
    reg = tf.keras.layers.Embedding(
        V_REG, DIM, embeddings_regularizer=tf.keras.regularizers.l2(0.1),
        name=f"{prefix}_reg_embedding")(ids[:, 2])
    con = tf.keras.layers.Embedding(V_CON, DIM, name=f"{prefix}_other_embedding")(ids[:, 3])
    x = tf.keras.layers.Concatenate()([a, frozen, reg, con])
    out = tf.keras.layers.Dense(1, name=f"{prefix}_dense")(x)
    return tf.keras.Model(ids, out)


def table(model, suffix):
    return [layer for layer in model.layers if layer.name.endswith(suffix)][0]


def value(layer):
    """A layer's table, ``[V, D]`` in id order, for comparisons."""
    return np.asarray(tf.convert_to_tensor(layer.embeddings))


def data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, V_A, n), rng.integers(0, V_FROZEN, n),
                    rng.integers(0, V_REG, n), rng.integers(0, V_CON, n)], axis=1)
    y = (ids[:, :1] % 2).astype("float32")
    return tf.data.Dataset.from_tensor_slices((ids.astype("int64"), y)).batch(16).repeat()


def constraint_holds(strategy):
    """`embeddings_constraint` with a Keras (non-legacy) optimizer, which applies it.

    (Keras's legacy optimizers refuse a constraint on a sparse gradient in
    one process too: "Cannot use a constraint function on a sparse variable".)
    """
    with strategy.scope():
        ids = tf.keras.Input((1,), dtype="int64")
        x = tf.keras.layers.Embedding(
            V_CON, DIM, embeddings_constraint=tf.keras.constraints.NonNeg(),
            embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05),
            name="nonneg_embedding")(ids)
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(x)))
        model.compile(tf.keras.optimizers.SGD(0.5), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.integers(0, V_CON, (128, 1)).astype("int64")
    ds = tf.data.Dataset.from_tensor_slices((x, np.ones((128, 1), "float32"))).batch(16)
    model.fit(ds.repeat(), epochs=1, steps_per_epoch=6, verbose=0)
    low = float(np.min(value(table(model, "nonneg_embedding"))))
    check("constraint_holds", low >= 0.0, low)


def adam_keeps_frozen_and_other_tables(strategy):
    """The frozen-table and two-model points with Adam, whose update moves every row it owns.

    (With table stacking, one Adam apply to a stack would move the rows of
    tables it was not given: each model's trainable tables must have a
    stack of their own.)
    """
    tf.keras.utils.set_random_seed(1)
    with strategy.scope():
        m1, m2 = build_model("a1"), build_model("a2")
        m1.compile(tf.keras.optimizers.Adam(0.05), loss="mse")
    frozen = value(table(m1, "frozen_embedding"))
    other = [value(table(m2, s)) for s in ("item_embedding", "frozen_embedding")]
    before = value(table(m1, "item_embedding"))
    m1.fit(data(seed=2), epochs=1, steps_per_epoch=6, verbose=0)
    check("adam_frozen_table_does_not_train",
          np.array_equal(frozen, value(table(m1, "frozen_embedding"))))
    check("adam_other_model_untouched",
          all(np.array_equal(a, value(table(m2, s)))
              for a, s in zip(other, ("item_embedding", "frozen_embedding"))))
    check("adam_trainable_table_trains",
          not np.array_equal(before, value(table(m1, "item_embedding"))))


def main():
    tf_psplugin.start_server()
    if "unstacked" in sys.argv[1:]:
        strategy = tf_psplugin.HybridParameterServerStrategy(
            options=tf_psplugin.HybridOptions(stack_tables=False))
    else:
        strategy = tf_psplugin.HybridParameterServerStrategy()
        assert strategy.options.stack_tables  # What this run checks: the default.
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        m1 = build_model("m1")
        m2 = build_model("m2")  # A target network / teacher / EMA copy.
        m1.compile(tf.keras.optimizers.legacy.Adagrad(0.5), loss="mse")
        m2.compile(tf.keras.optimizers.legacy.Adagrad(0.5), loss="mse")

    def weights_are_own_tables():
        layer = table(m1, "item_embedding")
        shapes = [tuple(w.shape) for w in layer.weights]
        rows = sum(s[0] for s in shapes)
        names_ok = all("item_embedding" in w.name for w in layer.weights)
        check("layer_weights_are_own_table",
              rows == V_A and all(s[1] == DIM for s in shapes) and names_ok,
              [(w.name, tuple(w.shape)) for w in layer.weights])
        check("count_params_is_own_table", layer.count_params() == V_A * DIM,
              layer.count_params())
        trainable_names = [v.name for v in m1.trainable_variables]
        check("trainable_variables_name_tables",
              any("m1_item_embedding" in n for n in trainable_names)
              and not any("frozen" in n for n in trainable_names)
              and not any(n.startswith("m2_") for n in trainable_names), trainable_names)

    attempt("layer_weights_are_own_table", weights_are_own_tables)

    before = {s: value(table(m1, s)) for s in ("item_embedding", "frozen_embedding")}
    before_m2 = [w.copy() for w in m2.get_weights()]

    def regularizer_is_the_tables_own():
        layer = table(m1, "reg_embedding")
        own = 0.1 * float(np.sum(np.square(value(layer))))
        losses = [float(x) for x in m1.losses]
        # One loss per shard, as Keras adds for any sharded variable.
        check("regularizer_covers_own_table", abs(sum(losses) - own) < 1e-6, (losses, own))

    attempt("regularizer_covers_own_table", regularizer_is_the_tables_own)
    history = m1.fit(data(), epochs=2, steps_per_epoch=8, verbose=0)
    check("fit_trains", history.history["loss"][-1] < history.history["loss"][0],
          history.history["loss"])
    check("frozen_table_does_not_train",
          np.array_equal(before["frozen_embedding"], value(table(m1, "frozen_embedding"))),
          "frozen table moved")
    check("trainable_table_trains",
          not np.array_equal(before["item_embedding"], value(table(m1, "item_embedding"))))
    moved = [i for i, (a, b) in enumerate(zip(before_m2, m2.get_weights()))
             if not np.array_equal(a, b)]
    check("other_model_untouched", not moved, moved)

    def set_weights_copies_tables():
        m2.set_weights(m1.get_weights())
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(m1.get_weights(), m2.get_weights()))
        check("set_weights_copies_tables",
              diff == 0.0 and np.array_equal(value(table(m1, "item_embedding")),
                                             value(table(m2, "item_embedding"))), diff)

    attempt("set_weights_copies_tables", set_weights_copies_tables)

    emb = table(m1, "item_embedding")
    try:
        out = emb(tf.constant([[V_A]], tf.int64))
        check("out_of_range_id_fails", False, f"id {V_A} returned {out.numpy().tolist()}")
    except (tf.errors.InvalidArgumentError, ValueError):
        check("out_of_range_id_fails", True)

    def safe_lookup_missing_id():
        ids = tf.sparse.SparseTensor([[0, 0], [1, 0]], tf.constant([-1, 3], tf.int64), [2, 1])
        out = tf.nn.safe_embedding_lookup_sparse(emb.embeddings, ids, combiner="sum")
        row3 = emb(tf.constant([3], tf.int64)).numpy()[0]
        check("safe_lookup_missing_id_is_zeros",
              np.array_equal(out.numpy()[0], np.zeros(DIM, "float32"))
              and np.allclose(out.numpy()[1], row3), out.numpy().tolist())

    attempt("safe_lookup_missing_id_is_zeros", safe_lookup_missing_id)
    attempt("constraint_holds", lambda: constraint_holds(strategy))
    attempt("adam_frozen_table_does_not_train",
            lambda: adam_keeps_frozen_and_other_tables(strategy))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
