"""Quiet by default: TensorFlow's INFO chatter from the plugin's code paths is off.

Why this module exists: connecting to a cluster, building the strategy and
joining the coordinator make TensorFlow log at INFO -- the chief's session
config dumped field by field, "ParameterServerStrategy (CentralStorageStrategy
if you are using a single machine) with compute_devices = ...", "Waiting for
all global closures to be finished" at every checkpoint -- and re-parsing the
plugin's flags makes absl log "unparse_flags() called" in every task. None of
it is actionable; it buried the job's own lines (issue 16). `quiet_tf_info()`
raises the level of the loggers that emit those lines to WARNING for the
duration of the plugin's own calls only; the user's own TensorFlow logging
elsewhere is untouched, and warnings and errors always show.

The switch: ``TF_PSPLUGIN_VERBOSITY=info`` (or ``python -m
tf_psplugin.launch --verbosity info``, which also sets
``TF_CPP_MIN_LOG_LEVEL=0`` for the tasks) shows everything again.
"""

import contextlib
import logging
import os
import re
import threading
from typing import Dict, Iterator

VERBOSITY_ENV = "TF_PSPLUGIN_VERBOSITY"
VERBOSITIES = ("warning", "info")

# TensorFlow's Python logger, absl's (some TF modules log through absl.logging), and
# the root logger (absl's flags module logs there).
TF_LOGGER = "tensorflow"
ABSL_LOGGER = "absl"
ROOT_LOGGER = ""

# C++ log lines: absl style on TF >= 2.16 (I0000 00:00:1795.. 123 port.cc:153] ...), and
# TF 2.15's own (2026-11-24 01:26:43.602532: I tensorflow/core/util/port.cc:113] ...).
# Python's absl lines look like the first but name a .py file; they are never dropped.
_CPP_LOG_LINE = re.compile(
    r"^(?:([IWEF])\d{4} [\d:.]+ +\d+ |\d{4}-\d\d-\d\d [\d:.]+: ([IWEF]) )"
    r"[\w./-]+\.(?:cc|h|cpp):\d+\] ")
_ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called"
# Second lines of multi-line INFO messages (TF 2.15's CPU-feature guard).
_CONTINUATIONS = ("To enable the following instructions",)

_lock = threading.Lock()
_depth: Dict[str, int] = {}
_saved_levels: Dict[str, int] = {}


def verbosity() -> str:
    """``"warning"`` (default: TF's INFO lines hidden) or ``"info"``.

    Raises:
        ValueError: if ``TF_PSPLUGIN_VERBOSITY`` holds anything else.
    """
    value = os.environ.get(VERBOSITY_ENV, "warning").strip().lower() or "warning"
    if value not in VERBOSITIES:
        raise ValueError(
            f"{VERBOSITY_ENV}={value!r} is not a verbosity. Fix: set it to one of "
            f"{', '.join(VERBOSITIES)} (or unset it for the quiet default).")
    return value


@contextlib.contextmanager
def quiet_tf_info(*logger_names: str) -> Iterator[None]:
    """Hides INFO records of some loggers inside the block (re-entrant, thread-safe).

    The first block to enter raises a logger's level to WARNING (only if its
    effective level was lower) and the last to leave restores it. With
    ``TF_PSPLUGIN_VERBOSITY=info`` it does nothing.

    Args:
        *logger_names: any of `TF_LOGGER` (TensorFlow's Python logging, the
            default), `ABSL_LOGGER` (absl.logging, which some TF modules use)
            and `ROOT_LOGGER` (stdlib logging at the root, as absl's flags use).
    """
    if verbosity() == "info":
        yield
        return
    names = logger_names or (TF_LOGGER,)
    with _lock:
        for name in names:
            _depth[name] = _depth.get(name, 0) + 1
            if _depth[name] == 1:
                logger = logging.getLogger(name)
                _saved_levels[name] = logger.level
                if logger.getEffectiveLevel() < logging.WARNING:
                    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        with _lock:
            for name in names:
                _depth[name] -= 1
                if _depth[name] == 0:
                    logging.getLogger(name).setLevel(_saved_levels.pop(name))


class CppLogFilter:
    """Applies TF_CPP_MIN_LOG_LEVEL to TensorFlow C++ log lines in a text stream.

    TF 2.16+ prints its oneDNN and CPU-feature INFO lines at import through
    absl, ignoring TF_CPP_MIN_LOG_LEVEL (measured with tensorflow-cpu 2.21.0),
    so `_compat` (our own import of TF) and the launcher (a task's output,
    when the script imported TF first) drop them here. Call it once per line,
    in order: it returns whether to keep the line. Lines that are not C++
    log lines are kept, except the known continuation of a dropped one.

    Args:
        level: 0 keeps everything; 1 drops INFO; 2 WARNING too; 3 ERROR too.
    """

    def __init__(self, level: int):
        self.level = level
        self._dropping = False

    def __call__(self, line: str) -> bool:
        if self.level < 1:
            return True
        if line.startswith(_ABSL_PREAMBLE):
            return False
        match = _CPP_LOG_LINE.match(line)
        if match:
            self._dropping = "IWEF".index(match.group(1) or match.group(2)) < self.level
        elif not (self._dropping and line.startswith(_CONTINUATIONS)):
            self._dropping = False
        return not self._dropping


def cpp_log_level(environ) -> int:
    """TF_CPP_MIN_LOG_LEVEL from `environ` (0 when unset or not a number)."""
    try:
        return int(environ.get("TF_CPP_MIN_LOG_LEVEL", "0") or 0)
    except ValueError:
        return 0
