"""What the tables need from the strategy that holds them: the `TableHost` interface.

Why this module exists: a `DynamicEmbedding` has to run its admission ops
right after its shard's optimizer update in a synchronous step, and
incremental checkpoints have to stamp the rows every update touches. Only the
strategy's extended object knows where updates happen, but the tables sit
below the strategy and must not import it. So the tables declare here what
they need, and `runtime.strategy.HybridExtended` implements it; `current`
finds it in the current strategy scope.
"""

import abc
from typing import Callable, Optional

import tensorflow as tf

__all__ = ["TableHost", "current"]


class TableHost(abc.ABC):
    """The strategy side of tables on PS tasks (implemented by `HybridExtended`)."""

    # The strategy's table options the tables read, with their defaults.
    # `HybridOptions.experimental_fuse_lookups`: fused lookups of every table.
    fuse_lookups: bool = False

    @property
    def table_stacks(self):
        """The strategy's `stacking.TableStacks` (``stack_tables=True``), or None."""
        return None

    @abc.abstractmethod
    def run_after_update(self, shard, fn: Callable[[], Optional[tf.Operation]]) -> None:
        """Makes the worker that updates `shard` in a sync step also run `fn()` after it."""

    @abc.abstractmethod
    def admits_after_update(self) -> bool:
        """True while a sync step is traced whose table updates run `run_after_update` hooks."""

    @abc.abstractmethod
    def track_updated_rows(self, shard, stamps) -> None:
        """Makes every optimizer apply to table `shard` also call `stamps.mark(grad)`."""

    @abc.abstractmethod
    def is_table_var(self, var) -> bool:
        """Whether `var` is a shard of a table this strategy made (incremental checkpoints)."""

    @abc.abstractmethod
    def create_plain_variable(self, device: str, **kwargs) -> tf.Variable:
        """A plain variable on `device`, even in the strategy's scope (not a table or replica)."""


def current() -> Optional[TableHost]:
    """The current strategy's `TableHost` (its extended object), or None."""
    if not tf.distribute.has_strategy():
        return None
    extended = tf.distribute.get_strategy().extended
    return extended if isinstance(extended, TableHost) else None
