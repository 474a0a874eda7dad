"""Device names of the cluster's tasks, written one way everywhere.

Why this module exists: tables, their optimizer slots, the sparse-gradient
queues and the Estimator's row-sharded tables are all placed on a PS task's
CPU by name, and the placement report prints those names; one spelling keeps
them comparable.
"""

__all__ = ["ps_device"]


def ps_device(task: int) -> str:
    """The device of PS task `task`'s CPU, e.g. ``/job:ps/task:1/device:CPU:0``."""
    return f"/job:ps/task:{int(task)}/device:CPU:0"
