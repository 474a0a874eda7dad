"""Every process-wide patch the plugin makes to TensorFlow, Keras or Python, in one place.

Why this module exists: a few things the plugin needs have no public hook in
TensorFlow or Keras (where Keras sums duplicate gradient rows, how it picks
the progress bar, how a functional model runs its layers, ...), so the
plugin replaces a function or method for the whole process. Those
replacements used to be installed by seven modules, each with its own flag
and lock, and none could be undone. Here is the one list of them: what each
replaces, why, on which TensorFlow versions it was checked, and the
function that applies it. Each apply function lives beside the code it
serves and returns the function that undoes it.

Nothing is patched at import. `install(name)` applies a patch once per
process (thread-safe; later calls do nothing); the strategy installs what
its options need when it is built (`HybridParameterServerStrategy`, see
docs/api.md, "What building a strategy changes"). `uninstall(name)` and
`uninstall_all()` restore the originals, newest first, e.g. at the end of a
test or a notebook that goes on without the plugin; a strategy built
afterwards installs them again.

Each patch names its apply function as ``"module:function"`` and imports it
only when installed: the declarations sit at the bottom layer, but the code
of each patch stays in its own layer, and no module here imports one above
it.
"""

import dataclasses
import importlib
import threading
from typing import Callable, Dict, List, Tuple

__all__ = ["PATCHES", "Patch", "install", "installed", "uninstall", "uninstall_all"]


@dataclasses.dataclass(frozen=True)
class Patch:
    """One process-wide patch.

    Attributes:
        name: Short name, the key for `install` and `uninstall`.
        replaces: What is replaced (module-qualified, as in TF 2.15's Keras).
        why: Why the plugin needs it.
        tf_versions: The TensorFlow (and Keras) versions it was checked on.
        apply: ``"module:function"``; the function applies the patch and
            returns a callable that undoes it.
    """

    name: str
    replaces: Tuple[str, ...]
    why: str
    tf_versions: str
    apply: str


# Keep in step with docs/api.md ("What building a strategy changes").
PATCHES: Tuple[Patch, ...] = (
    Patch(
        name="exit_on_failover_error",
        replaces=("sys.excepthook", "atexit (one handler)"),
        why=("an uncaught FailoverError ends the chief with one line and its exit code "
             "(138: restart me), and a chief that gave up on a hung task exits instead "
             "of waiting on it forever"),
        tf_versions="any",
        apply="tf_psplugin.fault.failover:patch_exit_hook"),
    Patch(
        name="keras_progress_bar",
        replaces=("keras.src.engine.training._get_verbosity",
                  "keras.src.callbacks.CallbackList._add_default_callbacks"),
        why=("fit/evaluate(verbose=1) under the strategy show the plugin's ProgressBar, and "
             "ChiefCheckpoint's train-end save runs after every other callback's"),
        tf_versions="Keras 2.15, tf-keras 2.16-2.21",
        apply="tf_psplugin.keras.progress:patch_keras_progress"),
    Patch(
        name="keras_data_handler",
        replaces=("keras.src.engine.data_adapter.get_data_handler",),
        why=("in synchronous mode every worker's epoch ends at the same step: Keras gets "
             "the agreed epoch length and pads evaluation input"),
        tf_versions="Keras 2.15, tf-keras 2.16-2.21",
        apply="tf_psplugin.runtime.epochs:patch_data_handler"),
    Patch(
        name="keras_dedup_on_ps",
        replaces=("keras.src.optimizers.optimizer.Optimizer._deduplicate_sparse_grad",),
        why="duplicate gradient rows of a table are summed on the PS that holds them",
        tf_versions="Keras 2.15, tf-keras 2.16-2.21",
        apply="tf_psplugin.sync.sparse_exchange:patch_keras_dedup"),
    Patch(
        name="keras_loss_scaling",
        replaces=("keras.src.mixed_precision.loss_scale_optimizer.strategy_supports_loss_scaling",
                  "keras.src.mixed_precision.loss_scale_optimizer._is_all_finite",
                  "keras.src.mixed_precision.loss_scale_optimizer._DynamicLossScaleState.update",
                  "keras.src.mixed_precision.loss_scale_optimizer.LossScaleOptimizerV3"
                  ".apply_gradients",
                  "keras.src.mixed_precision.loss_scale_optimizer.LossScaleOptimizer"
                  ".apply_gradients"),
        why=("mixed_float16: Keras's LossScaleOptimizer runs under the synchronous strategy; "
             "its 'every gradient is finite' check (table gradients included) is agreed by "
             "all workers in the step's all-reduce, so all apply the step or none does"),
        tf_versions="Keras 2.15, tf-keras 2.21",
        apply="tf_psplugin.sync.loss_scaling:patch_keras_loss_scaling"),
    Patch(
        name="safe_embedding_lookup_v1",
        replaces=("tf.compat.v1.nn.safe_embedding_lookup_sparse dispatch for ShardedVariable",),
        why=("feature columns' v1 safe lookups use an interleaved table's own 'mod' "
             "layout; TF's own target for ShardedVariable is unregistered and replaced by "
             "one that does the same for a plain ShardedVariable"),
        tf_versions="2.15-2.21",
        apply="tf_psplugin.tables.lookups:patch_safe_lookup_v1"),
    Patch(
        name="keras_functional_fusion",
        replaces=("keras.src.engine.functional.Functional._run_internal_graph",
                  "keras.src.engine.node.Node.map_arguments",
                  "keras.src.engine.training.Model.__call__"),
        why=("a functional model's embedding lookups at one depth run as one gather per "
             "PS (fuse_lookups, stack_tables), and any model's stacks (functional in its "
             "run, subclassed in its __call__) are split from other models' before its "
             "first traced call"),
        tf_versions="Keras 2.15, tf-keras 2.16-2.21",
        apply="tf_psplugin.tables.fusion:patch_keras_functional"),
    Patch(
        name="keras_stacked_updates",
        replaces=("keras.optimizers.Optimizer.apply_gradients",
                  "keras.optimizers.Optimizer._distributed_apply_gradients_fn",
                  "build of the known elementwise optimizers",
                  "keras.optimizers.legacy.Optimizer.apply_gradients",
                  "keras.optimizers.legacy.Optimizer._create_all_weights",
                  "keras.optimizers.legacy.Optimizer._distributed_apply",
                  "keras.optimizers.legacy.Optimizer.add_slot"),
        why=("stack_tables: the tables' gradients are merged into one apply per stack "
             "shard, and slots are made for the stack shards, listed per table"),
        tf_versions="Keras 2.15, tf-keras 2.16-2.21",
        apply="tf_psplugin.tables.stacked_updates:patch_keras_optimizers"),
    Patch(
        name="retrace_after_split",
        replaces=("tensorflow.python.eager.polymorphic_function.polymorphic_function.Function"
                  ".__call__",
                  "tensorflow.python.eager.polymorphic_function.concrete_function"
                  ".ConcreteFunction.__call__"),
        why=("stack_tables: a tf.function traced before its tables' stack was split apart "
             "and called outside the coordinator (a serving function, Keras's "
             "predict_function) is traced anew on the new stacks before it runs, instead of "
             "failing on the old, emptied storage (a ConcreteFunction called by hand, which "
             "cannot be, fails naming why); installed only at the first such split"),
        tf_versions="2.15-2.21",
        apply="tf_psplugin.tables.stacked_fallback:patch_retrace_after_split"),
)

_BY_NAME: Dict[str, Patch] = {p.name: p for p in PATCHES}
_lock = threading.RLock()
_undo: Dict[str, Callable[[], None]] = {}  # installed patches, in install order


def _apply_function(patch: Patch) -> Callable[[], Callable[[], None]]:
    module, _, function = patch.apply.partition(":")
    return getattr(importlib.import_module(module), function)


def install(name: str) -> None:
    """Applies patch `name` unless it is already applied (thread-safe)."""
    patch = _BY_NAME.get(name)
    if patch is None:
        raise KeyError(f"tf_psplugin: no patch named {name!r}; known: {sorted(_BY_NAME)}")
    with _lock:
        if name in _undo:
            return
        undo = _apply_function(patch)()
        if not callable(undo):
            raise TypeError(f"tf_psplugin: {patch.apply} returned {undo!r}, not an undo function")
        _undo[name] = undo


def installed() -> List[str]:
    """The names of the patches applied in this process, in the order applied."""
    with _lock:
        return list(_undo)


def uninstall(name: str) -> None:
    """Restores what patch `name` replaced (nothing if it is not applied)."""
    with _lock:
        undo = _undo.pop(name, None)
        if undo is not None:
            undo()


def uninstall_all() -> None:
    """Restores everything every applied patch replaced, newest first."""
    with _lock:
        for name in reversed(list(_undo)):
            uninstall(name)
