"""Opt-in recovery inside one process: run training again after a task failure.

By default a worker or PS failure ends the chief with `TaskFailedError`
(exit status 138) and whatever restarts the chief resumes from the latest
checkpoint (see `failover.py`). Where no launcher or scheduler restarts the
chief (a notebook, a script run by hand), wrap the training in `run`, in
the spirit of Horovod's elastic `run` decorator:

```python
def train():
    strategy = tf_psplugin.HybridParameterServerStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(...)
    # ChiefCheckpoint restores the latest checkpoint at train begin.
    model.fit(dataset, steps_per_epoch=steps, callbacks=[
        tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=1000)])
    return model

model = tf_psplugin.elastic.run(train)
```

`run` calls `train_fn`; when it raises `TaskFailedError`, `run` waits for
the failed tasks to accept connections again (something must still restart
them: the launcher's `--restart-failed`, a pod restart policy) and calls
`train_fn` again. `train_fn` must therefore build its strategy and model
itself and restore from the checkpoint; everything outside it runs once.
The interpreter is never replaced.
"""

import gc
import os
import time
from typing import Any, Callable, Optional

from absl import logging

from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster import liveness
from tf_psplugin.fault import failover as failover_lib


def run(train_fn: Callable[..., Any], *args, max_restarts: int = 20,
        recovery_timeout_seconds: Optional[float] = None,
        poll_seconds: Optional[float] = None, **kwargs) -> Any:
    """Calls `train_fn(*args, **kwargs)`, again after each task failure.

    Args:
        train_fn: Builds the strategy and model, restores the latest
            checkpoint and trains; its return value is returned.
        *args: Passed to `train_fn`.
        max_restarts: How many task failures to recover from before the
            last `TaskFailedError` is raised as a `FailoverError`.
        recovery_timeout_seconds: How long to wait for the failed tasks to
            accept connections again after a failure. None: the
            `FailoverPolicy.recovery_timeout_seconds` of the strategy that
            raised the failure (300 s by default).
        poll_seconds: Probe interval while waiting. None: the policy's
            `poll_seconds` (0.5 s by default).
        **kwargs: Passed to `train_fn`.

    Returns:
        What `train_fn` returned.

    Raises:
        FailoverError: a failed task did not come back in time, or the
            restart budget is spent (the last failure is chained).
        Exception: anything else `train_fn` raises, unchanged.
    """
    restarts = 0
    while True:
        os.environ[config_lib.CHIEF_RESTARTS_ENV] = str(restarts)
        try:
            return train_fn(*args, **kwargs)
        except failover_lib.TaskFailedError as e:
            if restarts >= max_restarts:
                raise failover_lib.FailoverError(
                    f"{', '.join(e.failed_tasks) or 'a task'} failed after {restarts} "
                    f"recoveries (max_restarts={max_restarts}); giving up. Fix: look at the "
                    "failed tasks' logs, or raise max_restarts.") from e
            restarts += 1
            policy = e.policy if e.policy is not None else failover_lib.FailoverPolicy()
            _wait_for_tasks(e, policy.recovery_timeout_seconds
                            if recovery_timeout_seconds is None else recovery_timeout_seconds,
                            policy.poll_seconds if poll_seconds is None else poll_seconds)
            logging.warning("tf_psplugin elastic: %s back; running training again "
                            "(recovery %d/%d)", ", ".join(sorted(e.addresses)) or "cluster",
                            restarts, max_restarts)
            # Drop the failed attempt's strategy and model before building new ones.
            del e
            gc.collect()


def _wait_for_tasks(error: "failover_lib.TaskFailedError", timeout: float,
                    poll: float) -> None:
    """Waits until every task the error names accepts connections again."""
    addresses = error.addresses
    logging.warning("tf_psplugin elastic: waiting up to %g s for %s to accept connections",
                    timeout, ", ".join(sorted(addresses)) or "the cluster")
    pending = liveness.wait_for_listeners(addresses, timeout, poll)
    if pending:
        names = ", ".join(f"{task} at {addresses[task]}" for task in pending)
        raise failover_lib.FailoverError(
            f"{names} did not come back within {timeout:g} s after a failure; training "
            f"stopped ({_resume_text(error.checkpoint)}). Fix: restart the task (the launcher's "
            "--restart-failed, or your scheduler's restart policy) and run again; or raise "
            "recovery_timeout_seconds.") from error
    time.sleep(1.0)  # A server that just started listening may still be initialising.


def _resume_text(checkpoint: Optional[str]) -> str:
    if checkpoint:
        return f"a rerun resumes from checkpoint {checkpoint}"
    return "no checkpoint was written, so a rerun starts over"
