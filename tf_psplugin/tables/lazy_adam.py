"""A row-local (lazy) Adam for embedding tables: moments change only for the gradient's rows.

Why this module exists: Keras's Adam, given a sparse gradient, still decays
the first and second moments of *every* row of a table each step
(``m = beta_1 * m`` on the whole slot) and then moves every row whose
moment is not zero. A step that looks up 1% of a table writes all of it:
incremental checkpoints (``full_every_saves``) would write whole tables in every
delta, and a table on a PS is read and written in full per step. TF Addons'
``LazyAdam`` and TFRA's lazy Adam instead update, for a sparse gradient,
only the rows it holds: those rows get exactly Adam's update from their
stored moments; the other rows and their moments stay as they are.

The difference from Keras's Adam: a row not looked up in a step keeps its
moments undecayed until it is looked up again, and does not move in that
step (Keras's Adam keeps moving it by its decaying momentum). For a row
updated in every step, both are the same. Dense gradients (dense layers)
get Keras's Adam unchanged. This is the usual choice for large sparse
tables; see docs/checkpoints.md.
"""

import tensorflow as tf

from tf_psplugin._internal.compat import keras

__all__ = ["LazyAdam"]


class LazyAdam(keras.optimizers.Adam):
    """Adam whose sparse updates change only the gradient's rows (and their moments).

    Drop-in for ``tf.keras.optimizers.Adam`` (same arguments, except
    ``amsgrad``, which it does not support). Incremental checkpoints
    (``full_every_saves``) accept it: its sparse update is row-local.

    Example:

    ```python
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=tf_psplugin.LazyAdam(0.001), loss="binary_crossentropy")
    ```

    Args:
        learning_rate: As Keras's Adam.
        beta_1: As Keras's Adam.
        beta_2: As Keras's Adam.
        epsilon: As Keras's Adam.
        amsgrad: Must be False.
        name: The optimizer's name.
        **kwargs: Keras's other optimizer arguments (``clipnorm``,
            ``global_clipnorm``, ...), passed to Keras's Adam unchanged.

    Raises:
        ValueError: ``amsgrad=True``.
    """

    # Read by incremental checkpoints: a sparse update writes only its rows.
    row_local_sparse_updates = True

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False, name="LazyAdam", **kwargs):
        if amsgrad:
            raise ValueError("LazyAdam(amsgrad=True) is not supported. Fix: amsgrad=False, "
                             "or tf.keras.optimizers.Adam(amsgrad=True).")
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, amsgrad=False, name=name, **kwargs)

    def update_step(self, gradient, variable):
        """Keras's Adam step; for a sparse gradient, on the gradient's rows only."""
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        # Keras's Adam's arithmetic, in its order, on the gradient's rows: a row
        # updated in every step ends bit for bit where Keras's dense path puts it.
        lr = tf.cast(self.learning_rate, dtype)
        local_step = tf.cast(self.iterations + 1, dtype)
        beta_1_power = tf.pow(tf.cast(self.beta_1, dtype), local_step)
        beta_2_power = tf.pow(tf.cast(self.beta_2, dtype), local_step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        index = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[index], self._velocities[index]
        # Keras has summed duplicate indices already (_deduplicate_sparse_grad).
        rows, values = gradient.indices, gradient.values
        m_rows = tf.gather(m, rows)
        m_rows = m_rows + (values - m_rows) * (1 - self.beta_1)
        v_rows = tf.gather(v, rows)
        v_rows = v_rows + (tf.square(values) - v_rows) * (1 - self.beta_2)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        v.scatter_update(tf.IndexedSlices(v_rows, rows))
        variable.scatter_sub(tf.IndexedSlices(
            (m_rows * alpha) / (tf.sqrt(v_rows) + self.epsilon), rows))

    def get_config(self):
        config = super().get_config()
        config.pop("amsgrad", None)
        return config
