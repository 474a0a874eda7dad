"""tf_psplugin: embedding tables on parameter servers, dense variables in AllReduce.

The public API is listed here and only here (see `__all__`). Anything imported
from a private module is not part of the API.
"""

from tf_psplugin import _compat  # noqa: F401  (raises ImportError on Keras 3)
from tf_psplugin._version import __version__

__all__ = ["__version__"]
