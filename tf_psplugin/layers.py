"""Public module: Keras layers (`DynamicEmbedding`).

The code lives in `tf_psplugin.tables.dynamic`.
"""

from tf_psplugin.tables.dynamic import (  # noqa: F401  (the public names)
    DynamicEmbedding,
    EVICTION_POLICIES,
)

__all__ = ["DynamicEmbedding", "EVICTION_POLICIES"]
