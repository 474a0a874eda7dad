"""The ClusterCoordinator contract, checked against one cluster in one chief.

Used by tests/cluster/test_coordinator_contract.py. Each check prints
`CHECK <name> ok` or `CHECK <name> FAIL <why>`; the script goes on after a
failed check so one run reports them all, and ends with `DONE`.

What stock ParameterServerStrategy does, and this must do too:
* `schedule` only takes a tf.function (TypeError otherwise);
* an error in a per-worker dataset function is the user's error
  (`ClosureInputError` wrapping the original), raised once, no failover, and
  the cluster stays usable;
* once an error is raised, the steps scheduled before it are cancelled and
  the next `join` starts clean;
* a deleted per-worker dataset and iterator are freed;
* a second strategy in the same process trains too.
"""

import faulthandler
import gc
import os
import sys
import time
import weakref

import numpy as np
import tensorflow as tf

import tf_psplugin
from tf_psplugin._internal.tf_internal import cluster_coordinator, coordinator_values
from tf_psplugin.cluster import liveness
from tf_psplugin.fault import failover
from checks import check  # tests/cluster/scripts/checks.py

ClusterCoordinator = tf.distribute.experimental.coordinator.ClusterCoordinator
# Bad-record rounds: before the delayed cancellation, ~1 in 20 left a peer
# waiting in a collective on a loaded 2-core host (TF 2.21).
PIPELINE_ERROR_ROUNDS = 8
HANG_DUMP_SECONDS = 400  # The test allows 500.


def good_dataset_fn(_=None):
    return tf.data.Dataset.range(1_000_000).map(lambda x: tf.cast(x % 7, tf.float32)).batch(4)


def bad_dataset_fn(_=None):
    # Fails at run time on the worker, not while tracing on the chief: the
    # reshape's input size (5) is unknown until the random op runs.
    n = tf.random.uniform([], 5, 6, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices(tf.reshape(tf.range(n), [2, -1]))


@tf.function
def sum_step(iterator):
    return tf.reduce_sum(next(iterator))


@tf.function
def failing_step(iterator):
    x = next(iterator)
    tf.debugging.assert_less(tf.reduce_sum(x), -1.0, message="user assertion in the step")
    return tf.reduce_sum(x)


def check_schedule_rejects_python_functions(coordinator, it):
    try:
        coordinator.schedule(lambda i: 1, args=(it,))
    except TypeError as e:
        # Stock's message, which users' `except` clauses and TF's tests match.
        check("schedule_typeerror",
              "only accepts a `tf.function` or a concrete function" in str(e), e)
    else:
        check("schedule_typeerror", False, "a Python function was accepted")


def check_input_error_is_the_users(coordinator):
    bad = iter(coordinator.create_per_worker_dataset(bad_dataset_fn))
    coordinator.schedule(sum_step, args=(bad,))
    try:
        coordinator.join()
    except cluster_coordinator.ClosureInputError as e:
        original = e.original_exception
        check("input_error_type", isinstance(original, tf.errors.InvalidArgumentError),
              repr(original))
        check("input_error_not_a_failure", not liveness.is_task_failure(e), e)
    except Exception as e:  # pylint: disable=broad-except
        check("input_error_type", False, f"{type(e).__name__}: {e}")
    else:
        check("input_error_type", False, "join() raised nothing")
    check("input_error_no_restart", os.environ.get(failover.RESTARTS_ENV, "0") == "0",
          os.environ.get(failover.RESTARTS_ENV))
    try:
        coordinator.join()
        check("input_error_raised_once", True)
    except Exception as e:  # pylint: disable=broad-except
        check("input_error_raised_once", False, f"{type(e).__name__}: {e}")


def check_errors_cancel_pending_steps(coordinator, it):
    pending = []
    raised = 0
    try:
        coordinator.schedule(failing_step, args=(it,))
        # The failing step may fail before these are scheduled: then the
        # next `schedule` raises its error (as stock's does), not `join`.
        for _ in range(5):
            pending.append(coordinator.schedule(sum_step, args=(it,)))
        coordinator.join()
    except tf.errors.InvalidArgumentError as e:
        raised += 1
        check("step_error_is_users", "user assertion" in str(e), e)
    cancelled = 0
    for remote in pending:
        try:
            remote.fetch()
        except tf.errors.CancelledError:
            cancelled += 1
        except Exception as e:  # pylint: disable=broad-except
            check("pending_cancelled", False, f"{type(e).__name__}: {e}")
    try:
        coordinator.join()
        coordinator.join()
    except Exception as e:  # pylint: disable=broad-except
        raised += 1
        check("error_raised_once", False, f"raised again: {type(e).__name__}: {e}")
    check("error_raised_once", raised == 1, raised)
    check("pending_cancelled", cancelled == len(pending), f"{cancelled} of {len(pending)}")


def check_still_usable(coordinator, it):
    try:
        value = coordinator.schedule(sum_step, args=(it,))
        coordinator.join()
        check("still_usable", float(value.fetch()) >= 0, value.fetch())
    except Exception as e:  # pylint: disable=broad-except
        check("still_usable", False, f"{type(e).__name__}: {e}")


def check_per_worker_dataset_freed(coordinator):
    ds = coordinator.create_per_worker_dataset(good_dataset_fn)
    it = iter(ds)
    coordinator.schedule(sum_step, args=(it,))
    coordinator.join()
    refs = [weakref.ref(ds), weakref.ref(it)]
    del ds, it
    gc.collect()
    alive = [r for r in refs if r() is not None]
    check("per_worker_dataset_freed", not alive,
          [gc.get_referrers(r())[:3] for r in alive])


def check_pipeline_error_on_one_worker(coordinator, strategy, good):
    """A bad record in one worker's input, mid-epoch, while its peer waits in a collective.

    The user's error is reported (not a cancellation, not a hung peer), at
    once, without failover, and the next step runs at once. `main` runs it
    several times: a peer left waiting in the step's collective (a lost
    cancellation) blocks every later collective of the group, so the next
    round's steps would hang.
    """
    def dataset_fn():
        index = tf.distribute.coordinator.experimental_get_current_worker_index()

        def validate(x):
            # Worker 1's fourth record is bad (and only that one).
            tf.debugging.assert_none_equal(x + tf.cast(index, tf.int64) * 1000,
                                           tf.constant(1003, tf.int64), message="bad record")
            return tf.cast(x, tf.float32)

        return tf.data.Dataset.range(100).map(validate).batch(1).repeat()

    @tf.function
    def step(iterator):
        x = next(iterator)
        return strategy.run(
            lambda v: tf.distribute.get_replica_context().all_reduce("sum", tf.reduce_sum(v)),
            args=(x,))

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    start = time.monotonic()
    try:
        for _ in range(6):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        check("pipeline_error_is_users", False, "join() raised nothing")
    except tf.errors.InvalidArgumentError as e:
        check("pipeline_error_is_users", "bad record" in str(e), e)
    except Exception as e:  # pylint: disable=broad-except
        check("pipeline_error_is_users", False, f"{type(e).__name__}: {e}")
    try:
        value = coordinator.schedule(sum_step, args=(good,))
        coordinator.join()
        took = time.monotonic() - start
        check("usable_at_once_after_pipeline_error",
              float(value.fetch()) >= 0 and took < 20
              and os.environ.get(failover.RESTARTS_ENV, "0") == "0", f"took {took:.1f}s")
    except Exception as e:  # pylint: disable=broad-except
        check("usable_at_once_after_pipeline_error", False, f"{type(e).__name__}: {e}")

    @tf.function
    def spread(iterator):
        # 0 iff every worker's next record is the same (its position in the input).
        x = next(iterator)

        def fn(v):
            ctx = tf.distribute.get_replica_context()
            n = float(strategy.num_replicas_in_sync)
            total = ctx.all_reduce("sum", tf.reduce_sum(v))
            return n * ctx.all_reduce("sum", tf.reduce_sum(v * v)) - total * total

        return strategy.run(fn, args=(x,))

    # The failing step read a record on every worker (the bad one on worker
    # 1), whichever worker got there first: the inputs stay in step.
    try:
        value = coordinator.schedule(spread, args=(it,))
        coordinator.join()
        check("iterators_aligned_after_pipeline_error", float(value.fetch()) == 0.0,
              float(value.fetch()))
    except Exception as e:  # pylint: disable=broad-except
        check("iterators_aligned_after_pipeline_error", False, f"{type(e).__name__}: {e}")


def check_repeated_iterators_released(coordinator):
    """TF's ClusterCoordinatorTest.testRepeatedIteratorCreation, in our words.

    Ten rounds of two new iterators each; once the last ones are dropped, no
    per-worker resource made since the check began, but variables (the strategy's own step counters and
    replicas are per-worker variables, which stock PSS's test has none of)
    is still alive on any worker.
    """
    def alive_resources():
        return {id(r()): type(r()).__name__
                for w in coordinator._cluster.workers  # pylint: disable=protected-access
                for r in w._resource_remote_value_refs  # pylint: disable=protected-access
                if r() is not None and not isinstance(r(), coordinator_values.RemoteVariable)}

    def input_fn():
        return tf.data.Dataset.range(1, 100)

    before = alive_resources()  # The iterators of the checks before this one.
    d1 = coordinator.create_per_worker_dataset(input_fn)
    d2 = coordinator.create_per_worker_dataset(input_fn)

    @tf.function
    def worker_fn(iterator1, iterator2):
        return next(iterator1) + next(iterator2)

    for _ in range(10):
        it1, it2 = iter(d1), iter(d2)
        result = coordinator.schedule(worker_fn, args=(it1, it2))
        for _ in range(10):
            coordinator.schedule(worker_fn, args=(it1, it2))
        coordinator.join()
        if result.fetch() < 2:
            check("repeated_iterators_released", False, result.fetch())
            return
    del it1, it2, d1, d2, result
    gc.collect()
    alive = [name for key, name in alive_resources().items() if key not in before]
    check("repeated_iterators_released", not alive, alive)


def fit_small_model(strategy, seed):
    tf.keras.utils.set_random_seed(seed)  # Also seeds Python's `random`.
    ids = np.random.default_rng(seed).integers(0, 50, size=(256, 2)).astype("int64")
    y = (ids.sum(axis=1, keepdims=True) % 2).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(16).repeat()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((2,), dtype="int64"),
                                     tf.keras.layers.Embedding(50, 4),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.legacy.SGD(0.1), "mse")
    history = model.fit(ds, epochs=1, steps_per_epoch=8, verbose=0)
    return history.history["loss"][-1]


def main():
    # A hang prints every thread's stack (and ends the script) well before
    # the test's own timeout kills it silently.
    faulthandler.dump_traceback_later(HANG_DUMP_SECONDS, exit=True)
    tf_psplugin.start_server()
    # A user error must not trigger failover; if a step hangs anyway, the
    # watchdog and failover end the script in ~1 min instead of waiting.
    policy = failover.FailoverPolicy(task_restarts=True, recovery_timeout_seconds=20)
    strategy = tf_psplugin.HybridParameterServerStrategy(
        failover=policy, options=tf_psplugin.HybridOptions(collective_timeout_seconds=30))
    coordinator = ClusterCoordinator(strategy)
    good = iter(coordinator.create_per_worker_dataset(good_dataset_fn))
    check_schedule_rejects_python_functions(coordinator, good)
    check_input_error_is_the_users(coordinator)
    check_still_usable(coordinator, good)
    check_errors_cancel_pending_steps(coordinator, good)
    check_still_usable(coordinator, good)
    check_per_worker_dataset_freed(coordinator)
    check_repeated_iterators_released(coordinator)
    for _ in range(PIPELINE_ERROR_ROUNDS):
        check_pipeline_error_on_one_worker(coordinator, strategy, good)
    try:
        first = fit_small_model(strategy, seed=1)
        second_strategy = tf_psplugin.HybridParameterServerStrategy(failover=policy)
        second = fit_small_model(second_strategy, seed=1)
        check("second_strategy_trains", np.isfinite(first) and np.isfinite(second),
              (first, second))
    except Exception as e:  # pylint: disable=broad-except
        check("second_strategy_trains", False, f"{type(e).__name__}: {e}")
    print("DONE", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
