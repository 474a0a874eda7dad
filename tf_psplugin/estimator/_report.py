"""`PlacementReportHook`: where did every variable of an Estimator model go?

Why this module exists: an Estimator builds its graph inside
``train_and_evaluate``, out of the user's reach, so the only way to see the
placement the plugin chose is from a session hook. The hook logs the shared
placement summary (`tf_psplugin.tables.placement.format_summary`: tables in full,
the rest grouped) when training starts
and can write it as JSON, one file per task -- which is also how the cluster
tests assert "tables on PS, dense on the workers".
"""

import json
import os
from typing import Dict, List, Optional

import tensorflow as tf
from absl import logging

from tf_psplugin.tables import placement as placement_lib


def _task_name() -> str:
    task = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}").get("task", {})
    return f"{task.get('type', 'local')}_{task.get('index', 0)}"


def _devices(variable) -> List[str]:
    values = getattr(variable, "values", None)  # Mirrored: one component per device.
    if values is not None and not callable(values):
        return [v.device for v in values]
    return [variable.device]


def _name(variable) -> str:
    return variable.name.split(":")[0]


def placement_records(
    policy: Optional[placement_lib.PlacementPolicy] = None,
) -> List[placement_lib.PlacementRecord]:
    """Describes every global and trainable variable of the default graph.

    ``kind`` is ``"table"`` for table shards, ``"table_slot"`` for their
    optimizer state, ``"dense"`` otherwise (whatever the device: in the
    ``ps_async`` fallback dense variables live on PS too).

    Args:
        policy: The table rule used to label variables; default rule if None.

    Returns:
        One record per variable (mirrored variables once, with all devices).
    """
    policy = policy or placement_lib.PlacementPolicy()
    seen: Dict[str, placement_lib.PlacementRecord] = {}
    variables = tf.compat.v1.global_variables() + tf.compat.v1.trainable_variables()
    unique = {}
    for v in variables:
        unique.setdefault(_name(v), v)
    tables = [
        name for name, v in unique.items()
        if policy.is_table(name, v.shape.as_list(), v.dtype.base_dtype.size)
    ]
    for name, v in unique.items():
        shape = tuple(int(d) if d is not None else -1 for d in v.shape.as_list())
        dtype = v.dtype.base_dtype
        if name in tables:
            kind = placement_lib.KIND_TABLE
        elif any(f"{t}/" in name for t in tables):  # Optimizer state of a table.
            kind = placement_lib.KIND_TABLE + "_slot"
        else:
            kind = placement_lib.KIND_DENSE
        seen[name] = placement_lib.PlacementRecord(
            name=name,
            kind=kind,
            shape=shape,
            dtype=dtype.name,
            num_bytes=placement_lib.num_bytes(shape, dtype.size),
            devices=tuple(_devices(v)),
        )
    return list(seen.values())


class PlacementReportHook(tf.compat.v1.train.SessionRunHook):
    """Logs where each variable lives; optionally writes it as JSON.

    Example:

    ```python
    hook = tf_psplugin.estimator.PlacementReportHook("/shared/run1/placement")
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(input_fn, max_steps=100, hooks=[hook]),
        eval_spec)
    # -> /shared/run1/placement/placement_chief_0.json, placement_worker_0.json, ...
    ```

    Args:
        output_dir: Directory for ``placement_<task>_<index>.json``; None only
            logs.
        policy: The table rule used to label variables.
    """

    def __init__(self, output_dir: Optional[str] = None,
                 policy: Optional[placement_lib.PlacementPolicy] = None):
        self._output_dir = output_dir
        self._policy = policy

    def begin(self):
        """Collects the placement once the graph is complete."""
        records = placement_records(self._policy)
        logging.info("%s", placement_lib.format_summary(records))
        if self._output_dir:
            tf.io.gfile.makedirs(self._output_dir)
            path = os.path.join(self._output_dir, f"placement_{_task_name()}.json")
            with tf.io.gfile.GFile(path + ".tmp", "w") as f:
                json.dump([r.to_dict() for r in records], f, indent=1)
            tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
