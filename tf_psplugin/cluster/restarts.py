"""How a restarted task learns about restarts: the environment the launcher sets.

Why this module exists: restarting failed tasks is split between a process
that imports no TensorFlow (the launcher, `cluster/local_cluster.py`, or a
scheduler) and the training processes (the chief's failover,
`fault/failover.py`, and `fault/elastic.py`). They agree through two
environment variables, named once here so that the launcher can set them
without importing the TensorFlow side. The exit status that asks for a
restart is `errors.RESTART_EXIT_CODE`.
"""

__all__ = ["TASK_RESTARTS_ENV", "CHIEF_RESTARTS_ENV"]

# "1" if failed workers/PS tasks are restarted by something (the launcher's
# --restart-failed, a scheduler), "0" if not. The launcher sets it for every
# task; the chief's failover reads it (failover.FailoverPolicy.task_restarts).
TASK_RESTARTS_ENV = "TF_PSPLUGIN_TASK_RESTARTS"
# How many times the chief was restarted after such a failure; set by the
# launcher (and by tf_psplugin.elastic.run) for the restarted chief.
CHIEF_RESTARTS_ENV = "TF_PSPLUGIN_CHIEF_RESTARTS"
