"""Failover: survive a dead worker or PS without losing training.

Why this design. Stock TF reschedules asynchronous closures when a worker
dies and gives up when a PS dies. Synchronous hybrid training is harder: a
step is a collective among all workers, and a PS restart loses the table
shards it held (TF cannot re-home the chief's remote variable handles). What
does survive every single failure is (a) the shared `model_dir` and (b) the
processes that did not die. So recovery is:

1. **Detect.** The coordinator sees the failed step (RPC errors within a
   second or two of a kill; a hung peer surfaces through the coordinator's
   step watchdog after `collective_timeout_seconds`). The failed tasks are
   read from the errors and confirmed by probing every task's port.
2. **Save what survives (worker failure).** If the dead task was a worker,
   the tables on the PS tasks and the dense replicas on any surviving worker
   are intact. Two per-worker counters, read on every survivor, tell whether
   the failed step was half-applied (gradients reduced but updates not all
   done) or applied by some survivors only. If neither, the chief saves an
   *emergency checkpoint* right now: only the in-flight step is lost. If it
   was (a kill inside the few milliseconds
   between the collectives and the end-of-step barrier), nothing is saved and
   the latest periodic checkpoint is used instead, so no update is ever
   applied twice.
3. **Stop, and let the restart resume.** The chief raises `TaskFailedError`
   naming the failed task and the checkpoint to resume from. Uncaught, it
   ends the chief with exit status `RESTART_EXIT_CODE` (138) and a one-line
   message, so whatever restarts the chief does so: the launcher's
   `--restart-failed`, or a TFJob's `restartPolicy: ExitCode` (Kubeflow's
   code for a user-defined retryable error). The restarted chief waits for
   every task, restores the latest checkpoint (tables into however many PS
   tasks there are, dense variables, optimizer slots, step counter, input
   position) and trains on. Before raising, the chief makes the surviving
   workers restart too (collective members restart together, see
   `_restart_surviving_workers`), but only when something will restart them:
   when nothing will (`FailoverPolicy.task_restarts` False; the launcher
   says so through `TF_PSPLUGIN_TASK_RESTARTS=0` when run without
   `--restart-failed`), the chief raises `FailoverError` instead (exit status
   1), naming the dead task and the checkpoint, and leaves the healthy tasks
   alone. We stop rather than continue with fewer workers: the collective
   group size, the global batch and the data sharding are all functions of
   the worker count, and silently changing them changes the model you train.

The library never replaces the process or re-runs the user's code by
itself. Recovery inside one process is opt-in: `tf_psplugin.elastic.run(
train_fn)` catches `TaskFailedError`, waits for the failed tasks to come
back and calls `train_fn` again (it builds a new strategy and restores).

A PS failure skips step 2 (its shards are gone): steps lost are at most the
checkpoint interval. A chief failure is the same as step 4 done by whoever
restarts the chief. The evaluator never joins the training cluster, so its
failure cannot affect training.
"""

import atexit
import dataclasses
import os
import sys
import threading
import time
from typing import Dict, Optional, Set, Tuple

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import context, executor
from tf_psplugin.cluster import restarts as restarts_lib
from tf_psplugin.cluster import liveness
from tf_psplugin.cluster.liveness import accepts_connections, tasks_named_in
from tf_psplugin.errors import RESTART_EXIT_CODE, FailoverError, TaskFailedError  # noqa: F401  (see errors.py)
from tf_psplugin.errors import StrategyError
from tf_psplugin.state import checkpoint as checkpoint_lib
from tf_psplugin.state import model_dir as model_dir_lib

RESTARTS_ENV = restarts_lib.CHIEF_RESTARTS_ENV
# Read when FailoverPolicy.task_restarts is None (see cluster/restarts.py).
TASK_RESTARTS_ENV = restarts_lib.TASK_RESTARTS_ENV


@dataclasses.dataclass(frozen=True)
class FailoverPolicy:
    """How the chief reacts to a dead worker or PS.

    Attributes:
        enabled: Recover automatically (else failures are raised as errors).
        recovery_timeout_seconds: How long `tf_psplugin.elastic.run` waits
            for a failed task to come back before stopping with an error
            (the `TaskFailedError` carries this policy to it; an explicit
            `elastic.run(recovery_timeout_seconds=...)` wins).
        poll_seconds: Probe interval while waiting (same rules).
        task_restarts: Whether something restarts a failed worker or PS task
            (the launcher's --restart-failed, a Kubernetes restart policy).
            False: the chief saves what survives and stops at once with an
            error naming the dead task. None (default): read
            `TF_PSPLUGIN_TASK_RESTARTS` ("0"/"1"), which the launcher sets;
            unset means True (a scheduler is assumed to restart tasks).
        settle_seconds: How long recovery waits for the failed step's parts
            still running on surviving workers to end before it reads their
            step counters (for the emergency checkpoint) and goes on
            without them. A part blocked in a collective with the failed
            peer never ends by itself, so a failover usually spends this
            whole wait; shorter means an emergency checkpoint is more often
            skipped for the periodic one (a survivor still applying its
            updates reads as half-applied). Must be >= 0.

    Raises:
        StrategyError: `settle_seconds` is negative or not a number.
    """

    enabled: bool = True
    recovery_timeout_seconds: float = 300.0
    poll_seconds: float = 0.5
    task_restarts: Optional[bool] = None
    settle_seconds: float = 10.0

    def __post_init__(self):
        if not (isinstance(self.settle_seconds, (int, float))
                and not isinstance(self.settle_seconds, bool) and self.settle_seconds >= 0):
            raise StrategyError(
                f"FailoverPolicy(settle_seconds={self.settle_seconds!r}) must be a number of "
                "seconds >= 0. Fix: pass e.g. settle_seconds=10.0 (the default), or 0 to go on "
                "at once without waiting for the failed step's parts.")

    def restarts_expected(self) -> bool:
        """`task_restarts`, or what the launcher said, or True."""
        if self.task_restarts is not None:
            return bool(self.task_restarts)
        value = os.environ.get(TASK_RESTARTS_ENV, "").strip().lower()
        if value in ("0", "false", "no"):
            return False
        return True


# Hung tasks this process gave up on (see `_exit_if_wedged`).
_wedged: Set[Tuple[str, int]] = set()
# The exit status an uncaught FailoverError asked for (see `patch_exit_hook`).
_exit_status = 1


def patch_exit_hook():
    """Ends the process cleanly on an uncaught `FailoverError`; returns the undo.

    Applied through `tf_psplugin._internal.patches` ("exit_on_failover_error").

    Wraps `sys.excepthook`: an uncaught `FailoverError` prints its one-line
    message (no traceback: the failover log lines above it say what
    happened) and exits with the error's `exit_code`, e.g. 138 for
    `TaskFailedError`. `finally` blocks and atexit handlers run as usual.
    Other exceptions go to the previous hook. Also registers
    `_exit_if_wedged` with atexit. Interactive shells (IPython,
    notebooks) do not use `sys.excepthook`: there the error is shown and the
    kernel lives on.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        global _exit_status
        if isinstance(exc, FailoverError):
            _exit_status = exc.exit_code
            sys.stdout.flush()
            sys.stderr.write(f"tf_psplugin: {exc}\n")
            sys.stderr.flush()
            raise SystemExit(exc.exit_code)
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    # See `_exit_if_wedged`: registered with the hook, when a strategy with
    # failover is built, never at import.
    atexit.register(_exit_if_wedged)

    def undo():
        if sys.excepthook is hook:
            sys.excepthook = previous
        atexit.unregister(_exit_if_wedged)

    return undo


def _exit_if_wedged() -> None:
    """At exit, skips TensorFlow's shutdown if a peer is hung.

    Why: when the interpreter finalizes, TF frees every traced function and
    tells each remote task to drop it (`context.remove_function`), with no
    deadline. A hung task (stopped, wedged) accepts the connection and never
    answers, so the chief would never exit after raising FailoverError
    (measured on TF 2.15 with a SIGSTOPped worker). Registered by
    `patch_exit_hook`, when the first strategy with failover is built, so
    it runs after the atexit handlers that user code registers later (atexit
    is last-in, first-out), and `finally` blocks have run by then too; only
    TF's own shutdown (and handlers registered before the strategy) is
    skipped, and only when a peer is hung.
    """
    if not _wedged:
        return
    _say("exiting without TensorFlow's shutdown: %s hung and would block it forever" % (
        ", ".join(f"{j}:{i}" for j, i in sorted(_wedged))))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


def _latest_checkpoint() -> Optional[str]:
    """The newest complete checkpoint in a registered checkpointer's model_dir."""
    for checkpointer in reversed(checkpoint_lib.live_checkpointers()):
        model_dir = getattr(checkpointer, "model_dir", None)
        try:
            info = model_dir_lib.latest_checkpoint_info(model_dir) if model_dir else None
        except Exception:  # noqa: BLE001 - only used to word an error message.
            info = None
        if info is not None:
            return info.path
    return None


def restarts_so_far() -> int:
    """How many times this chief has restarted itself."""
    try:
        return int(os.environ.get(RESTARTS_ENV, "0"))
    except ValueError:
        return 0


class FailoverController:
    """Runs the recovery described in the module docstring.

    Args:
        strategy: The `HybridParameterServerStrategy`.
        policy: A `FailoverPolicy`.
    """

    def __init__(self, strategy, policy: FailoverPolicy):
        self._strategy = strategy
        self.policy = policy
        spec = tf_objects.strategy_cluster_resolver(strategy).cluster_spec().as_dict()
        self._addresses = {(job, i): addr for job in ("worker", "ps")
                           for i, addr in enumerate(spec.get(job, []))}
        self._hung: Set[Tuple[str, int]] = set()  # Accept connections, never answer.
        # Tasks served by the chief's own process (an in-process cluster, as
        # TF's tests build): nothing can restart them, and aborting one
        # would end the chief, so failover stops with the error instead.
        self._in_process = sorted(t for t, address in self._addresses.items()
                                  if liveness.served_by_this_process(address))

    def recover(self, coordinator, error: BaseException) -> None:
        """Saves what survives `error`, then raises (never returns normally).

        Raises:
            TaskFailedError: something will restart the failed tasks; restart
                the chief (exit status 138 when uncaught) to resume.
            FailoverError: nothing will restart them; the healthy tasks were
                left running. The original error is chained to both.
        """
        _say(f"a training step failed: {type(error).__name__}: {_first_line(error)}")
        # Parts of the failed step on surviving workers end when their
        # collectives see the dead peer's RPC errors; parts stuck with a hung
        # peer never do (they end when their worker restarts), nor do parts
        # blocked in a collective with a dead one (measured on TF 2.15: no
        # error without a per-op timeout). The wait (policy.settle_seconds)
        # lets a survivor that was past the step's last collective finish
        # its updates, so the step counters read for the emergency
        # checkpoint are settled.
        if not coordinator.wait_until_idle(timeout=self.policy.settle_seconds):
            stuck = coordinator.running_parts()
            _say("step part(s) still running on %s; going on without them" % (
                ", ".join(f"worker:{i} (step {sid}, {secs:.0f} s)"
                          for i, (sid, secs) in sorted(stuck.items())) or "no worker"))
        failed = self._failed_tasks(error)
        _say("failed task(s): " + (", ".join(f"{j}:{i}" for j, i in sorted(failed)) or "unknown"))
        saved = None
        if failed and all(job == "worker" for job, _ in failed):
            saved = self._save_what_survives(coordinator, failed)
        elif any(job == "ps" for job, _ in failed):
            _say("a PS task failed: its table shards are lost; resuming from the latest "
                 "periodic checkpoint")
        if not self.policy.restarts_expected() or self._in_process:
            self._stop_without_restarts(failed, saved, error)
        restarted = self._restart_surviving_workers(coordinator, failed)
        self._stop_for_restart(failed, restarted, saved, error)

    def _stop_for_restart(self, failed, restarted, saved, error) -> None:
        """Raises TaskFailedError: the chief's restart resumes from the checkpoint."""
        names = ", ".join(f"{j}:{i} at {self._addresses[(j, i)]}" for j, i in sorted(failed)
                          if (j, i) in self._addresses) or "an unidentified task"
        latest = saved or _latest_checkpoint()
        resume = (f"a restart resumes from checkpoint {latest}" if latest else
                  "no checkpoint was written yet, so a restart starts over (add "
                  "tf_psplugin's checkpoint callback to keep progress)")
        waiting = set(failed) | set(restarted) or set(self._addresses)
        raise TaskFailedError(
            f"{names} failed; training stopped and {resume}. The chief exits with status "
            f"{RESTART_EXIT_CODE} (TaskFailedError) to be restarted. Fix: run it under the "
            "launcher's --restart-failed or a TFJob's restartPolicy: ExitCode, which restart it "
            "on that status; or wrap training in tf_psplugin.elastic.run(train_fn) to recover "
            "inside this process.",
            failed_tasks=[f"{j}:{i}" for j, i in sorted(failed)],
            addresses={f"{j}:{i}": self._addresses[(j, i)] for j, i in sorted(waiting)
                       if (j, i) in self._addresses},
            checkpoint=latest, policy=self.policy) from error

    def _failed_tasks(self, error) -> Set[Tuple[str, int]]:
        """Tasks that are down now, plus PS tasks the error blames.

        A PS named in the error may already be back (restarted by the
        launcher within a second); its shards are lost all the same. Workers
        named in errors are often just the ones that reported the failure.
        """
        failed = {t for t in tasks_named_in(error) if t in self._addresses and t[0] == "ps"}
        for task, address in self._addresses.items():
            if not accepts_connections(address):
                failed.add(task)
        if not failed:
            named = {t for t in tasks_named_in(error) if t in self._addresses}
            # A hung task accepts connections but does not answer; workers
            # merely waiting in a collective for it still serve reads. Every
            # worker is probed, not only those the watchdog named: it names
            # the workers of the oldest stuck step, and the hung one may
            # already have finished its part of that step (measured on TF
            # 2.21: the watchdog named worker:0, waiting for the SIGSTOPped
            # worker:1, which was stuck one step later).
            workers = sorted(t for t in self._addresses if t[0] == "worker")
            failed = self._unresponsive_workers(workers) or named
        return failed

    def _unresponsive_workers(self, tasks) -> Set[Tuple[str, int]]:
        """Workers among `tasks` that do not answer a read of their step counter."""
        counters = getattr(self._strategy.extended, "committed_steps", None)
        if counters is None:
            return set()
        silent = set()
        for job, index in tasks:
            if job != "worker":
                continue
            try:
                _call_with_timeout(lambda i=index: _read_replica(counters, i), 5.0)
            except TimeoutError:
                silent.add((job, index))
            except (tf.errors.OpError, ValueError):
                pass  # It answered, with an error: not hung.
        if silent:
            _say("not answering (hung): " + ", ".join(f"{j}:{i}" for j, i in sorted(silent)))
        self._hung |= silent
        return silent

    def _stop_without_restarts(self, failed, saved, error) -> None:
        """Raises FailoverError naming the dead tasks (nothing restarts them)."""
        names = ", ".join(f"{j}:{i} at {self._addresses[(j, i)]}" for j, i in sorted(failed)
                          if (j, i) in self._addresses) or "an unidentified task"
        _wedged.update(t for t in failed if t in self._hung)
        latest = saved or _latest_checkpoint()
        resume = (f"resume from checkpoint {latest}" if latest else
                  "no checkpoint was written, so a rerun starts over")
        if self._in_process:
            tasks = ", ".join(f"{j}:{i}" for j, i in self._in_process)
            raise FailoverError(
                f"{names} failed; {tasks} run in this process (an in-process cluster), where "
                f"nothing can restart them, so training stopped and every task was left "
                f"running; {resume}. Fix: if a step is legitimately slow, raise "
                "HybridOptions(collective_timeout_seconds=...); to survive "
                "task failures, run each task in its own process (python -m "
                "tf_psplugin.launch --restart-failed).") from error
        raise FailoverError(
            f"{names} failed and nothing will restart it (FailoverPolicy.task_restarts is "
            f"False, or {TASK_RESTARTS_ENV}=0: the launcher runs without --restart-failed); "
            f"training stopped, the healthy tasks were left running; {resume}. Fix: restart the "
            "failed task and rerun the chief, or launch with --restart-failed (a scheduler "
            f"restart policy and {TASK_RESTARTS_ENV}=1 on Kubernetes) so the job recovers by "
            "itself.") from error

    def _save_what_survives(self, coordinator, failed) -> Optional[str]:
        """Saves the emergency checkpoint if it is safe; returns its path.

        Safe means every surviving worker is readable and at the same
        committed step, with no step half-applied. With 3+ workers one
        survivor may have applied a step another never finished (its part
        of the collectives ended first); the PS tables then hold some of
        that step's rows, and a checkpoint from either survivor would label
        them with a step they do not belong to. Then, as when a survivor
        cannot be read, the latest periodic checkpoint is used instead.
        """
        survivors = [i for i in range(coordinator.num_workers) if ("worker", i) not in failed]
        checkpointers = checkpoint_lib.live_checkpointers()
        if not survivors or not checkpointers:
            if not checkpointers:
                _say("no checkpointer registered: nothing to save (add tf_psplugin's checkpoint "
                     "callback to keep progress across failures)")
            return None
        counts = self._survivor_counters(survivors)
        if counts is None:
            return None
        half = {i: rc for i, rc in counts.items() if rc[0] != rc[1]}
        if half:
            _say("the failed step was half-applied on %s: not saving it; the latest periodic "
                 "checkpoint will be used so no update is applied twice" % ", ".join(
                     f"worker:{i} (reduced {r}, committed {c})" for i, (r, c) in
                     sorted(half.items())))
            return None
        committed_steps = {c for _, c in counts.values()}
        if len(committed_steps) > 1:
            _say("surviving workers disagree on the last committed step (%s): the tables hold "
                 "part of a step, so no emergency checkpoint can label them; the latest "
                 "periodic checkpoint will be used" % ", ".join(
                     f"worker:{i} at {c}" for i, (_, c) in sorted(counts.items())))
            return None
        (committed,) = committed_steps
        survivor = survivors[0]
        coordinator.preferred_replica = survivor
        saved = None
        for checkpointer in checkpointers:
            try:
                path = _call_with_timeout(checkpointer.save_emergency, 120.0)
            except (tf.errors.OpError, OSError, ValueError, TimeoutError) as e:
                _say(f"emergency checkpoint failed ({type(e).__name__}: {_first_line(e)}); "
                     "the latest periodic checkpoint will be used")
                return None
            if path:
                saved = path
                _say(f"saved emergency checkpoint {path} from worker:{survivor}'s replicas "
                     f"({committed} committed steps on every surviving worker): only the "
                     "in-flight step is lost")
        if saved is None:
            # E.g. a checkpointer that saves each worker's input position: the
            # failed worker's is lost, so model and input would not agree.
            _say("no emergency checkpoint (the checkpointer declined, see above): the latest "
                 "periodic checkpoint will be used")
        return saved

    def _survivor_counters(self, survivors) -> Optional[Dict[int, Tuple[int, int]]]:
        """`{worker: (reduced, committed)}` for every survivor; None if one cannot be read."""
        extended = self._strategy.extended
        counts = {}
        for survivor in survivors:
            try:
                counts[survivor] = _call_with_timeout(lambda i=survivor: (
                    _read_replica(extended.reduced_steps, i),
                    _read_replica(extended.committed_steps, i)), 20.0)
            except (tf.errors.OpError, ValueError, TimeoutError) as e:
                _say(f"worker:{survivor} cannot be read ({type(e).__name__}), so whether it "
                     "applied a later step is unknown: the latest periodic checkpoint will be "
                     "used")
                return None
        return counts

    def _restart_surviving_workers(self, coordinator, failed) -> Set[Tuple[str, int]]:
        """Makes the surviving workers restart too; returns them.

        TensorFlow's collective runtime on a surviving worker keeps what it
        learned about the dead peer (its device incarnation) and the next
        collective with the restarted peer never completes (measured on TF
        2.15: the first step after recovery times out). Collective members
        must therefore all restart, as with MultiWorkerMirroredStrategy. PS
        tasks are not collective members: they keep running, tables intact.
        TF's `Abort` op ends the worker process with a non-zero status, so a
        restart policy (the launcher's --restart-failed, Kubernetes
        OnFailure/Always) brings it back.
        """
        restarted = set()
        for i in range(coordinator.num_workers):
            # Error messages also name healthy workers that merely reported
            # the failure, so every worker still answering is restarted.
            if not accepts_connections(self._addresses[("worker", i)]):
                continue
            device = f"/job:worker/replica:0/task:{i}/device:CPU:0"

            def abort(device=device):
                # Its own executor, drained and cleared here: the thread's
                # default one would raise the dying worker's "connection
                # reset" from `Executor.__del__` when the thread ends, which
                # Python prints as an ignored exception with a traceback.
                abort_executor = executor.new_executor(enable_async=False)
                try:
                    with context.executor_scope(abort_executor), tf.device(device):
                        tf.raw_ops.Abort(error_msg="tf_psplugin failover: restarting collective "
                                         "members after a peer failed", exit_without_error=False)
                finally:
                    try:
                        abort_executor.wait()
                    except tf.errors.OpError:
                        pass
                    abort_executor.clear_error()

            try:
                _call_with_timeout(abort, 10.0)
            except (tf.errors.OpError, RuntimeError, TimeoutError):
                pass  # Expected: the worker is gone before it can answer.
            restarted.add(("worker", i))
        if restarted:
            _say("asked surviving worker(s) %s to restart (collective members restart together)"
                 % ", ".join(f"worker:{i}" for _, i in sorted(restarted)))
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and any(
                    accepts_connections(self._addresses[t]) for t in restarted):
                time.sleep(0.2)
        return restarted

def _call_with_timeout(fn, seconds: float):
    """Runs `fn` on a helper thread; raises TimeoutError if it takes too long.

    Recovery must never hang on a remote call to a half-dead task; an
    abandoned call is cleaned up when the chief restarts itself.
    """
    result, error = [], []

    def run():
        try:
            result.append(fn())
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread.
            error.append(e)

    thread = threading.Thread(target=run, daemon=True, name="tf_psplugin-failover-call")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if error:
        raise error[0]
    return result[0] if result else None


def _read_replica(var, worker_index: int) -> int:
    return int(var.read_replica(worker_index).numpy())


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


def _say(message: str) -> None:
    # absl's WARNING reaches stderr whether or not the script set up logging.
    logging.warning("tf_psplugin failover: %s", message)

