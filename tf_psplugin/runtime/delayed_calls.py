"""One thread that runs callables at given times, and reports what they raise.

Why this module exists: the coordinator cancels a failed step's peers a
moment after their remote calls were sent (see `coordinator.py`,
`_cancel_waiting_peers`). A `threading.Timer` per cancellation did that
until TF's own test harness, which replaces `threading.Thread` with a
wrapper that requires ``target=``, made `Timer`'s constructor raise inside
the coordinator's dispatch thread: the thread died and `join()` waited
forever. Here one plain thread (made with ``target=``, started on first
use) runs every delayed call in deadline order, and an exception in a call
goes to ``on_error`` instead of ending the thread. The thread ends after
`IDLE_SECONDS` with nothing to run (and is made again when needed), so it
holds nothing of its owner alive for long.

Example:

```python
calls = DelayedCalls("tf_psplugin-cancel", on_error=print)
calls.call_later(1.0, manager.start_cancel)
...
calls.stop()
```
"""

import heapq
import itertools
import threading
import time
from typing import Callable, List, Optional, Tuple

from absl import logging

# The thread ends after this long with no call waiting.
IDLE_SECONDS = 30.0


class DelayedCalls:
    """Runs callables at deadlines on one daemon thread, in deadline order.

    Args:
        name: The thread's name.
        on_error: Called with ``(exception)`` on that thread when a call
            raises; the thread goes on with the next call.
        clock: The clock deadlines are measured on (injected by tests).
    """

    def __init__(self, name: str, on_error: Callable[[BaseException], None],
                 clock: Callable[[], float] = time.monotonic):
        self._name = name
        self._on_error = on_error
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # Ties run in the order they were added.
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Runs `fn()` `delay` seconds from now (at once if `delay` <= 0).

        A call added after `stop` is dropped.
        """
        with self._cond:
            if self._stopped:
                return
            heapq.heappush(self._heap, (self._clock() + max(delay, 0.0), next(self._order), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        """How many calls wait for their time."""
        with self._cond:
            return len(self._heap)

    def stop(self, timeout: Optional[float] = None) -> None:
        """Drops the calls not run yet and ends the thread (idempotent)."""
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _next_due(self) -> Optional[Callable[[], None]]:
        """Waits for the earliest call's time and pops it; None once stopped."""
        with self._cond:
            while not self._stopped:
                if not self._heap:
                    if not self._cond.wait(IDLE_SECONDS) and not self._heap:
                        self._thread = None  # `call_later` makes a new one.
                        return None
                    continue
                wait = self._heap[0][0] - self._clock()
                if wait <= 0:
                    return heapq.heappop(self._heap)[2]
                self._cond.wait(wait)
            return None

    def _run(self) -> None:
        while True:
            fn = self._next_due()
            if fn is None:
                return
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported, and the thread goes on.
                try:
                    self._on_error(e)
                except BaseException:  # noqa: BLE001 - a failing reporter must not end it.
                    logging.exception("tf_psplugin: %s: reporting %r failed", self._name, e)
