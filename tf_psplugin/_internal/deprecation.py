"""Renamed keyword arguments: the old name keeps working, with a warning.

Why this module exists: the public API names one thing one way across the
Keras and Estimator front-ends, and gives every duration in seconds as
``*_seconds``. Earlier releases used other names (``*_secs``, the
Estimator's ``mode``/``table_update``/``placement_policy``); scripts that
pass them keep running and are told the new name once per call site.

Every deprecation of the package warns with `PluginDeprecationWarning` (a
`DeprecationWarning`), so that a test suite can turn the plugin's own
deprecations into errors without touching TensorFlow's or Keras's (this
project's setup.cfg does).
"""

import warnings
from typing import Any


class _Unset:
    """The default of a deprecated keyword: "not passed" (None can be a real value)."""

    def __repr__(self):
        return "<unset>"


UNSET: Any = _Unset()


class PluginDeprecationWarning(DeprecationWarning):
    """A former tf_psplugin name or spelling was used; the message names the new one."""


def warn(message: str, stacklevel: int = 2) -> None:
    """Warns with `PluginDeprecationWarning`, attributed `stacklevel` frames up.

    Args:
        message: What is deprecated and what to use instead.
        stacklevel: As for `warnings.warn`, counted from the caller of `warn`.
    """
    warnings.warn(message, PluginDeprecationWarning, stacklevel=stacklevel + 1)


def renamed(owner: str, old: str, old_value: Any, new: str, new_value: Any,
            new_default: Any) -> Any:
    """The value of keyword `new`, taking `old` (its former name) if that was passed.

    Args:
        owner: What takes the keyword, for messages (e.g. "run_evaluator").
        old: The former keyword name.
        old_value: What was passed under it, or `UNSET`.
        new: The keyword's name now.
        new_value: What was passed under it (or its default).
        new_default: Its default, to tell whether both names were given.

    Returns:
        `old_value` if it was passed (after a `PluginDeprecationWarning`), else
        `new_value`.

    Raises:
        ValueError: if both names were passed, with different values.
    """
    if old_value is UNSET:
        return new_value
    if new_value is not new_default and new_value != new_default and new_value != old_value:
        raise ValueError(
            f"{owner}: {old}={old_value!r} and {new}={new_value!r} are the same option (`{old}` "
            f"is its former name). Fix: pass only {new}=...")
    warn(f"{owner}({old}=...) is deprecated: use {new}=...", stacklevel=3)
    return old_value
