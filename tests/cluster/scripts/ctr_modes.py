"""Chief script: train the synthetic CTR task in one strategy mode, report AUC.

argv: OUT_JSON EMBEDDING_UPDATES DENSE_PLACEMENT STEPS [stacked]. Held-out
AUC is computed on the chief from generator data far from the training
stream. "stacked": one Embedding per feature, stored in one stack
(stack_tables=True); otherwise one fused table.
"""

import json
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from tf_psplugin import data

OUT, UPDATES, DENSE, STEPS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
STACKED = len(sys.argv) > 5 and sys.argv[5] == "stacked"
VOCAB, DIM, BATCH = 1000, 8, 256


def make_model(num_features):
    dense_in = tf.keras.Input((data.NUM_INTEGER_FEATURES,), name="dense")
    cat_in = tf.keras.Input((num_features,), dtype="int64", name="categorical")
    if STACKED:
        columns = [tf.keras.layers.Embedding(VOCAB, DIM, name=f"emb_{f}")(
            tf.keras.layers.Lambda(lambda x, f=f: x[:, f], name=f"ids_{f}")(cat_in))
            for f in range(num_features)]
        flat = tf.keras.layers.Concatenate()(columns)
    else:
        offsets = tf.constant(np.arange(num_features, dtype="int64") * VOCAB)
        ids = tf.keras.layers.Lambda(lambda x: x + offsets)(cat_in)
        emb = tf.keras.layers.Embedding(num_features * VOCAB, DIM)(ids)  # One fused table.
        flat = tf.keras.layers.Flatten()(emb)
    x = tf.keras.layers.Concatenate()([flat, dense_in])
    x = tf.keras.layers.Dense(64, activation="relu", name="mlp_1")(x)
    x = tf.keras.layers.Dense(32, activation="relu", name="mlp_2")(x)
    out = tf.keras.layers.Dense(1, activation="sigmoid", name="logit")(x)
    return tf.keras.Model({"dense": dense_in, "categorical": cat_in}, out)


def main():
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(embedding_updates=UPDATES, dense_placement=DENSE,
                                          stack_tables=STACKED))
    gen = data.SyntheticCTR(vocab_size=VOCAB, seed=0)
    with strategy.scope():
        model = make_model(gen.num_categorical)
        model.compile(tf.keras.optimizers.legacy.Adam(2e-3), "binary_crossentropy",
                      steps_per_execution=10)
    model.fit(gen.dataset(BATCH), epochs=1, steps_per_epoch=STEPS, verbose=2)
    far = 1 << 30
    (features, labels), = gen.dataset(8192, num_batches=far + 1, offset_batches=far).take(1)
    scores = model.predict(features, batch_size=2048, verbose=0)
    auc = tf.keras.metrics.AUC(num_thresholds=2000)
    auc.update_state(labels, scores)
    with open(OUT, "w") as f:
        json.dump({"auc": float(auc.result()), "expected_auc": gen.expected_auc(),
                   "placement": [r.to_dict() for r in strategy.placement_records()]}, f)
    print("RESULT ok", flush=True)


if __name__ == "__main__":
    main()
