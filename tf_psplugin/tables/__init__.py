"""Layer 3, embedding tables on the PS tasks.

`placement` (which variables are tables), `layout` (which row lives on
which shard), `sharded` (the interleaved table type), `lookups` (TF's lookup
APIs dispatched to it), `fusion` and `stacking`/`stacked_updates` (fewer
round trips per step), `dynamic` (`DynamicEmbedding`, keyed by raw ids;
its per-PS state in `dynamic_state`, its row policy in `dynamic_admission`),
`key_hashing`, `shard_init` and `sliced_draw`. Uses `sync`, `cluster` and `_internal`. The
public face is `tf_psplugin.layers`.
"""

# TF's embedding-lookup APIs dispatch to interleaved tables once `lookups` is
# imported (`tf.experimental.dispatch_for_api`); importing any module of this
# package registers them, so a table never meets TF's own ShardedVariable
# lookup. (`sharded` itself does not import `lookups`: that was a cycle.)
from tf_psplugin.tables import lookups as _lookups  # noqa: E402,F401
