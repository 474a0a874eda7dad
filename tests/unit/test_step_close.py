"""The end of a sync step (`sync/replicated.py`): closed once, or once per tf.cond branch.

Keras's LossScaleOptimizer applies a step in one branch of a tf.cond and
skips it in the other; each branch must end the step (barrier and commit
counter) with the table updates made in it, and nothing else may end it
again. Traced without a cluster: `_close_step` only reads graph state.
"""

import tensorflow as tf

from tf_psplugin.sync import replicated


def _trace(fn):
    tf.function(fn).get_concrete_function()


def test_a_step_closes_once_in_its_graph():
    seen = []

    def step():
        replicated.open_step()
        replicated.add_pending_table_update(tf.constant(True, name="update"))
        seen.append(replicated._close_step())  # pylint: disable=protected-access
        seen.append(replicated._close_step())  # pylint: disable=protected-access

    _trace(step)
    assert [op.name.split(":")[0] for op in seen[0]] == ["update"], seen
    assert seen[1] is None


def test_each_branch_of_a_cond_closes_with_its_own_updates():
    seen = {}

    def step(flag):
        replicated.open_step()
        replicated.add_pending_table_update(tf.constant(True, name="before_cond"))

        def apply():
            replicated.add_pending_table_update(tf.constant(True, name="in_apply"))
            seen["apply"] = replicated._close_step()  # pylint: disable=protected-access
            seen["apply_again"] = replicated._close_step()  # pylint: disable=protected-access
            return tf.constant(1)

        def skip():
            seen["skip"] = replicated._close_step()  # pylint: disable=protected-access
            return tf.constant(0)

        tf.cond(flag, apply, skip)
        seen["after_cond"] = replicated._close_step()  # pylint: disable=protected-access

    _trace(lambda: step(tf.constant(True)))
    names = {k: None if v is None else sorted(t.name.split(":")[0].split("/")[-1] for t in v)
             for k, v in seen.items()}
    assert names == {"apply": ["before_cond", "in_apply"], "apply_again": None,
                     "skip": ["before_cond"], "after_cond": None}, names
