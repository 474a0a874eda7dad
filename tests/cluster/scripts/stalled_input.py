"""A job whose input never yields a batch: the watchdog says so, naming what it waits for.

Issue: an endless stream whose filter keeps nothing used to end in silence
(or a message blaming a hung worker). With the step watchdog at 5 s the
first step fails with one line that says no step has finished and the
input has not produced its first batch.
"""

import os
import sys
import time

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_psplugin  # noqa: E402
from checks import check  # noqa: E402


def main():
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(collective_timeout_seconds=5.0, log_placement=False),
        failover=tf_psplugin.FailoverPolicy(enabled=False))
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Embedding(50, 4),
                                     tf.keras.layers.GlobalAveragePooling1D(),
                                     tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.legacy.SGD(0.1), "mse")
    nothing = (tf.data.Dataset.range(10**9).filter(lambda x: x < 0)
               .map(lambda x: (tf.fill([3], x % 50), tf.cast(x, tf.float32))).batch(4))
    start = time.monotonic()
    try:
        model.fit(nothing, epochs=1, steps_per_epoch=3, verbose=0)
        check("stalled_input_named", False, "fit returned")
    except tf.errors.DeadlineExceededError as e:
        took = time.monotonic() - start
        check("stalled_input_named", "input has not produced its first batch" in e.message
              and "worker:0" in e.message and took < 60, f"took={took:.1f}s {e.message}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
