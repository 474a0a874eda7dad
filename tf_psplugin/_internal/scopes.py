"""A per-thread "inside this `with` block" flag, safe to nest.

Why this module exists: several parts of the plugin mark a region of code
for the code it calls (tables created inside `embedding_table_scope`,
writes inside an optimizer update, tables that must not be stacked), and
each needs the same thread-local depth counter.
"""

import contextlib
import threading


class ThreadScope:
    """Counts how deep this thread is inside `scope()`.

    Example:

    ```python
    _UNSTACKED = ThreadScope()
    with _UNSTACKED.scope():
        assert _UNSTACKED.active()
    ```
    """

    def __init__(self):
        self._local = threading.local()

    def depth(self) -> int:
        """How many `scope()` blocks this thread is inside."""
        return getattr(self._local, "depth", 0)

    def active(self) -> bool:
        """Whether this thread is inside a `scope()` block."""
        return self.depth() > 0

    @contextlib.contextmanager
    def scope(self):
        """Enters the scope for the `with` block."""
        depth = self.depth()
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
