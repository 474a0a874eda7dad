"""on_read_updates.OnReadUpdates in one process, with a stand-in collective group.

The stand-in "all-reduce" multiplies by the group size (every worker
contributed the same delta) and counts its calls, so these tests check the
contract: when an update is written, with how many collectives, in which
graph, and that a step never loses one (an update the step never reads
again is written by a replacement trace, as the coordinator does). The cluster tests check
the real step (tests/cluster/test_strategy.py: metrics equal to
single-process training, collectives per step).
"""

import threading

import pytest
import tensorflow as tf

from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.sync import on_read_updates

WORKERS = 3


class _Group:
    """Sums as if all WORKERS workers sent the same tensor; counts collectives."""

    def __init__(self):
        self.collectives = 0
        self.graphs = []  # the kind of graph each collective was traced in

    def all_reduce_packed(self, tensors, mean=False):
        self.collectives += 1
        self.graphs.append(type(tf.compat.v1.get_default_graph()).__name__)
        return [t * WORKERS / (WORKERS if mean else 1) for t in tensors]


class _Var:
    """An ON_READ variable as OnReadUpdates sees it; writes go to `.v`."""

    def __init__(self, name, aggregation=tf.VariableAggregation.SUM, value=0.0):
        self.v = tf.Variable(value, name=name)
        self.name = name
        self.dtype = self.v.dtype
        self.shape = self.v.shape
        self.aggregation = aggregation
        self.updates = None  # the OnReadUpdates whose flush a read triggers

    def assign_add(self, delta, read_value=True):
        return self.updates.update(self, delta, lambda d: self.v.assign_add(
            d, read_value=read_value), read_value)

    def assign_sub(self, delta, read_value=True):
        return self.updates.update(self, delta, lambda d: self.v.assign_sub(
            d, read_value=read_value), read_value, subtract=True)

    def read_value(self):
        self.updates.flush_if_pending(self)  # what ReplicatedVariable.handle does
        return self.v.read_value()


def _setup(*names, **kw):
    group = _Group()
    updates = on_read_updates.OnReadUpdates(group, WORKERS, **kw)
    variables = [_Var(n) for n in names]
    for v in variables:
        v.updates = updates
    return group, updates, variables


def test_updates_wait_and_ride_in_one_collective_with_the_gradient():
    group, updates, (total, count) = _setup("total", "count")

    @tf.function
    def step():
        total.assign_add(2.0)
        count.assign_add(1.0)
        assert group.collectives == 0  # recorded, not written
        grad = tf.constant([1.0, 1.0])
        pending = updates.take()
        summed = group.all_reduce_packed([grad] + updates.deltas(pending))
        updates.apply(pending, summed[1:])
        return summed[0]

    step()
    assert updates.left_pending() == []
    assert group.collectives == 1
    assert total.v.numpy() == 2.0 * WORKERS and count.v.numpy() == 1.0 * WORKERS


def test_a_read_writes_everything_pending_with_one_collective():
    group, updates, (a, b, c) = _setup("a", "b", "c")

    @tf.function
    def step():
        a.assign_add(1.0)
        b.assign_add(2.0)
        c.assign_add(3.0)
        return b.read_value()  # reads b: a, b and c are written first

    assert step().numpy() == 2.0 * WORKERS
    assert updates.left_pending() == []
    assert group.collectives == 1
    assert [v.v.numpy() for v in (a, b, c)] == [1.0 * WORKERS, 2.0 * WORKERS, 3.0 * WORKERS]


def test_mean_updates_are_averaged_and_unreduced_aggregations_stay_local():
    group, updates, _ = _setup()
    mean = _Var("m", tf.VariableAggregation.MEAN, value=10.0)
    local = _Var("l", tf.VariableAggregation.NONE)
    mean.updates = local.updates = updates

    @tf.function
    def step():
        mean.assign_add(-4.0)
        local.assign_add(5.0)
        return mean.read_value()

    assert step().numpy() == pytest.approx(6.0)
    assert local.v.numpy() == 5.0
    assert group.collectives == 1


def test_the_result_of_a_deferred_update_works_as_dependency_and_value():
    _, updates, (a,) = _setup("a")

    @tf.function
    def step():
        result = a.assign_add(1.0)
        with tf.control_dependencies([result]):
            grouped = tf.group([result, a.assign_add(1.0, read_value=False)])
        with tf.control_dependencies([grouped]):
            return tf.convert_to_tensor(result) + 0.0  # the value after the updates

    assert step().numpy() == 2.0 * WORKERS


def test_an_update_in_a_cond_branch_is_summed_locally_and_reduced_after_the_cond():
    # No collective in a branch: a predicate computed from a worker's own
    # batch would send only some workers into it.
    group, updates, (a,) = _setup("a")

    @tf.function
    def step(flag):
        tf.cond(flag, lambda: a.assign_add(1.0, read_value=False), tf.no_op)
        return a.read_value()  # after the cond: the branch's sum is written first

    assert step(tf.constant(True)).numpy() == 1.0 * WORKERS
    assert step(tf.constant(False)).numpy() == 1.0 * WORKERS  # the sum was zeroed
    assert step(tf.constant(True)).numpy() == 2.0 * WORKERS
    assert updates.left_pending() == []
    # Outside the branch (the first call traces twice: it created the sum's variable).
    assert set(group.graphs) == {"FuncGraph"}


def test_branch_updates_never_read_again_are_written_at_the_end_of_the_step():
    group, updates, (a,) = _setup("a")

    @tf.function(input_signature=[tf.TensorSpec([], tf.bool)])
    def step(flag):
        def add_then_read():
            a.assign_add(3.0, read_value=False)
            return a.read_value()  # cannot see the branch's own update yet

        def subtract_then_read():
            a.assign_sub(1.0, read_value=False)
            return a.read_value()

        return tf.cond(flag, add_then_read, subtract_then_read)

    run = _trace_like_the_coordinator(updates, step)
    run(tf.constant(True))
    run(tf.constant(False))
    run(tf.constant(True))
    assert a.v.numpy() == (3.0 - 1.0 + 3.0) * WORKERS
    assert updates.left_pending() == []
    assert "CondBranchFuncGraph" not in group.graphs


def test_updates_in_a_loop_body_are_flushed_there():
    group, updates, (a,) = _setup("a")

    @tf.function
    def steps():
        out = tf.constant(0.0)
        for _ in tf.range(4):
            a.assign_add(1.0)
            out = a.read_value()
        return out

    assert steps().numpy() == 4.0 * WORKERS
    assert updates.left_pending() == []
    assert group.collectives == 1  # traced once, in the loop body


def _trace_like_the_coordinator(updates, fn):
    """What HybridClusterCoordinator does: trace, and trace a replacement while
    a trace leaves updates pending. Returns the function it would run."""
    traced = updates.step_function(fn)
    for _ in range(3):
        traced.get_concrete_function()
        left = updates.left_pending()
        if not left:
            return traced
        traced = updates.replacement_for(fn, traced, left)
    raise AssertionError("still pending after the unpacked replacement")


def test_an_update_never_used_again_is_written_at_the_end_of_the_step():
    # TF's PSS tutorial: accuracy.update_state after apply_gradients, read
    # only after join().
    group, updates, (total, count) = _setup("total", "count")

    @tf.function
    def step():
        total.assign_add(2.0)
        count.assign_add(1.0)
        return tf.constant(0.0)

    run = _trace_like_the_coordinator(updates, step)
    assert run is not step and updates.step_function(step) is run  # remembered
    assert group.collectives == 1  # both written with one packed all-reduce
    run()
    assert total.v.numpy() == 2.0 * WORKERS and count.v.numpy() == 1.0 * WORKERS
    run()
    assert total.v.numpy() == 4.0 * WORKERS  # every step, not only the first
    assert _trace_like_the_coordinator(updates, step) is run  # no new trace


def test_an_update_left_in_a_loop_body_is_applied_where_it_happens():
    group, updates, (a,) = _setup("a")

    @tf.function
    def steps():
        for _ in tf.range(4):
            a.assign_add(1.0)
        return tf.constant(0.0)

    run = _trace_like_the_coordinator(updates, steps)
    run()
    assert a.v.numpy() == 4.0 * WORKERS
    assert updates.left_pending() == []


def _strategy_run(updates, fn):
    """What `strategy.run` does: mirrored_run traces `fn` in a thread of its
    own, in the caller's graph; the strategy then calls `end_of_run`."""
    graph = tf.compat.v1.get_default_graph()
    out = []

    def replica():
        with graph.as_default():
            out.append(fn())

    thread = threading.Thread(target=replica)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and out, "the replica thread did not finish"
    updates.end_of_run()
    return out[0]


def test_a_replica_function_in_a_loop_body_writes_its_updates_when_it_returns():
    # TF's testCustomTrainingLoop: `for _ in tf.range(n): strategy.run(fn)`,
    # fn updates a metric after apply_gradients and nothing reads it.
    group, updates, (total, count) = _setup("total", "count")

    def replica_fn():
        total.assign_add(2.0)
        count.assign_add(1.0, read_value=False)
        return tf.constant(0.0)

    @tf.function
    def steps():
        for _ in tf.range(4):
            _strategy_run(updates, replica_fn)
        return tf.constant(0.0)

    assert _trace_like_the_coordinator(updates, steps) is steps  # no replacement
    assert group.collectives == 1  # one packed all-reduce, in the loop body
    steps()
    assert total.v.numpy() == 4 * 2.0 * WORKERS and count.v.numpy() == 4 * 1.0 * WORKERS


def test_a_replica_function_in_the_step_itself_leaves_its_updates_waiting():
    # Outside a loop body they may still ride a later all-reduce.
    group, updates, (a,) = _setup("a")

    @tf.function
    def step():
        _strategy_run(updates, lambda: a.assign_add(1.0, read_value=False))
        assert group.collectives == 0
        pending = updates.take()
        updates.apply(pending, group.all_reduce_packed(updates.deltas(pending)))
        return tf.constant(0.0)

    step()
    assert group.collectives == 1 and a.v.numpy() == 1.0 * WORKERS


def test_the_unpacked_replacement_applies_updates_made_in_a_replica_thread():
    # An update left in a loop body by a replica function whose run ends
    # without `end_of_run`: the unpacked trace must catch it in the replica
    # thread too (it once used a thread-local flag the replica thread never saw).
    group, updates, (a,) = _setup("a")

    def replica_in_thread():
        graph = tf.compat.v1.get_default_graph()

        def replica():
            with graph.as_default():
                a.assign_add(1.0, read_value=False)

        thread = threading.Thread(target=replica)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive()

    @tf.function
    def steps():
        for _ in tf.range(3):
            replica_in_thread()
        return tf.constant(0.0)

    run = _trace_like_the_coordinator(updates, steps)
    run()
    assert a.v.numpy() == 3.0 * WORKERS
    assert updates.left_pending() == []


def test_updates_in_a_cond_inside_a_loop_body_are_exact():
    group, updates, (a, b) = _setup("a", "b")

    @tf.function
    def steps():
        for i in tf.range(6):
            def replica_fn():
                tf.cond(i % 2 == 0, lambda: a.assign_add(1.0, read_value=False), tf.no_op)
                b.assign_add(1.0, read_value=False)
            _strategy_run(updates, replica_fn)
        return tf.constant(0.0)

    assert _trace_like_the_coordinator(updates, steps) is steps
    steps()
    assert a.v.numpy() == 3.0 * WORKERS and b.v.numpy() == 6.0 * WORKERS


def test_the_replacement_keeps_the_input_signature():
    _, updates, (a,) = _setup("a")

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
    def step(x):
        a.assign_add(x)
        return x

    step.get_concrete_function()
    run = updates.replacement_for(step, step, updates.left_pending())
    assert run.input_signature == step.input_signature
    run(tf.constant(3.0))
    assert a.v.numpy() == 3.0 * WORKERS


def test_a_concrete_function_that_loses_an_update_is_refused():
    _, updates, (a,) = _setup("auc/true_positives")

    @tf.function
    def step():
        a.assign_add(1.0)
        return tf.constant(0.0)

    concrete = step.get_concrete_function()
    left = updates.left_pending()
    assert left == ["auc/true_positives"]
    with pytest.raises(StrategyError, match=r"'auc/true_positives'.*concrete function"):
        updates.replacement_for(concrete, concrete, left)


def test_with_packing_off_every_update_is_reduced_where_it_happens():
    group, updates, (a, b) = _setup("a", "b", enabled=False)

    @tf.function
    def step():
        a.assign_add(1.0)
        b.assign_add(1.0)
        return tf.constant(0.0)

    step()
    assert updates.left_pending() == []
    assert group.collectives == 2 and a.v.numpy() == b.v.numpy() == 1.0 * WORKERS


def test_with_packing_off_a_branch_update_is_still_reduced_outside_the_branch():
    group, updates, (a,) = _setup("a", enabled=False)

    @tf.function(input_signature=[tf.TensorSpec([], tf.bool)])
    def step(flag):
        tf.cond(flag, lambda: a.assign_add(1.0, read_value=False), tf.no_op)
        return tf.constant(0.0)

    run = _trace_like_the_coordinator(updates, step)
    run(tf.constant(True))
    run(tf.constant(True))
    assert a.v.numpy() == 2.0 * WORKERS
    assert "CondBranchFuncGraph" not in group.graphs
