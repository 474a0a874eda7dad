"""Metric values as plain Python floats, for eval results and summaries.

Why this module exists: Keras hands metric values back as numpy scalars,
tensors or anything else a callback put in `logs`; the evaluator's results
file and the training summaries both need a float or nothing.
"""

import math
from typing import Any, Optional

__all__ = ["to_float"]


def to_float(value: Any, finite: bool = False) -> Optional[float]:
    """`value` as a float, or None if it is not a number (or, with `finite`, not finite)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if finite and not math.isfinite(number) else number
