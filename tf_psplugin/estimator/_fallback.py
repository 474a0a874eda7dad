"""The explicit fallback: every variable on PS, asynchronous, tables sharded.

Why this module exists: ``RunConfig(mode="ps_async")`` is the escape hatch for
models the hybrid strategy cannot run (see docs/estimator.md): classic TF1
parameter-server training, where workers never talk to each other and each
applies its own gradients to variables on the PS tasks. It is stock
`tf.compat.v1.distribute.experimental.ParameterServerStrategy` (which puts
each variable whole on one PS task, round-robin), changed in one place: a
variable the shared `PlacementPolicy` calls a table is split into row shards
over all PS tasks, exactly as in hybrid mode, so checkpoints are
interchangeable between the two modes.

Private TensorFlow API (checked against TF 2.15.1): subclassing
`ParameterServerStrategyExtended`, the only way to change the variable
creation of a TF1 strategy.
"""

import tensorflow as tf

from tf_psplugin._internal.tf_internal import parameter_server_strategy as _pss
from tf_psplugin.estimator import _tables
from tf_psplugin.tables import placement as placement_lib


def empty_resolver() -> tf.distribute.cluster_resolver.ClusterResolver:
    """A resolver with no cluster: the strategy starts local and the
    distribute coordinator configures it for its task (no server started)."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))


class _PsAsyncExtended(_pss.ParameterServerStrategyExtended):
    """TF1 ParameterServerStrategy, with tables sharded over every PS task."""

    def __init__(self, container_strategy, policy: placement_lib.PlacementPolicy):
        self._policy = policy
        super().__init__(container_strategy, cluster_resolver=empty_resolver())

    def _create_variable(self, next_creator, **kwargs):
        cluster_spec = getattr(self, "_cluster_spec", None)
        num_ps = len(cluster_spec.as_dict().get("ps", [])) if cluster_spec else 0
        if (num_ps and kwargs.get("colocate_with") is None
                and _tables.is_table_request(self._policy, kwargs)
                and not _tables.already_partitioned(kwargs.get("name"))):
            return _tables.create_sharded_table(next_creator, kwargs, num_ps)
        return super()._create_variable(next_creator, **kwargs)


class PsAsyncStrategy(tf.compat.v1.distribute.experimental.ParameterServerStrategy):
    """Fallback: every variable on PS, asynchronous updates, tables sharded."""

    def __init__(self, policy: placement_lib.PlacementPolicy):
        tf.compat.v1.distribute.Strategy.__init__(
            self, _PsAsyncExtended(self, policy=policy)
        )
