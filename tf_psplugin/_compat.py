"""Version gate: which TensorFlow and which Keras the plugin runs on.

Why this module exists: ParameterServerStrategy only works with Keras 2
(tf.keras 2.15, or the `tf-keras` package on TF >= 2.16 with
`TF_USE_LEGACY_KERAS=1`). Keras 3 has no ParameterServerStrategy support at
all, and the failure it produces deep inside `model.fit` is unreadable. So we
check once, at import, and raise an ImportError that says what to install.

Everything else in the package imports Keras from here (`keras`), never
`tf.keras` directly, so the resolution happens in exactly one place.
"""

import os
import sys

import tensorflow as tf

TF_VERSION = tuple(int(p) for p in tf.__version__.split(".")[:2])

_KERAS3_HELP = (
    "tf_psplugin needs Keras 2: ParameterServerStrategy is not supported by Keras 3, "
    "which is what tf.keras resolves to on TensorFlow {tf} here. Fix: either install "
    "TensorFlow 2.15 (`pip install 'tensorflow-cpu==2.15.1' 'numpy<2'`), or keep TF "
    "{tf} and `pip install 'tf-keras=={major}.{minor}.*'` and set the environment variable "
    "TF_USE_LEGACY_KERAS=1 before TensorFlow is imported."
)
_LEGACY_ON_215_HELP = (
    "tf_psplugin: TF_USE_LEGACY_KERAS is set, so TensorFlow {tf} looks for the tf-keras "
    "package instead of its built-in Keras 2, and cannot import it ({error}). Fix: unset "
    "TF_USE_LEGACY_KERAS (Keras 2.15 is built into TF 2.15), or `pip install "
    "'tf-keras==2.15.*'`."
)


def _legacy_flag_set() -> bool:
    return os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in ("1", "true")


def _resolve_keras():
    """Returns the Keras 2 module behind `tf.keras`, or raises ImportError."""
    if TF_VERSION < (2, 15):
        raise ImportError(
            f"tf_psplugin supports TensorFlow 2.15 to 2.21; found {tf.__version__}. "
            "Fix: `pip install 'tensorflow-cpu==2.15.1' 'numpy<2'`."
        )
    if TF_VERSION >= (2, 16) and not _legacy_flag_set():
        raise ImportError(
            _KERAS3_HELP.format(tf=tf.__version__, major=TF_VERSION[0], minor=TF_VERSION[1])
            + " (TF_USE_LEGACY_KERAS is not set.)"
        )
    try:
        keras_module = tf.keras
        # tf.keras is a lazy loader without __version__; ask the package that
        # actually implements its layers (keras on 2.15, tf_keras with legacy).
        root = keras_module.layers.Layer.__module__.split(".")[0]
        version = getattr(sys.modules.get(root), "__version__", "")
    except ImportError as e:  # tf-keras missing with TF_USE_LEGACY_KERAS=1.
        if TF_VERSION < (2, 16):
            raise ImportError(_LEGACY_ON_215_HELP.format(tf=tf.__version__, error=e)) from e
        raise ImportError(
            _KERAS3_HELP.format(tf=tf.__version__, major=TF_VERSION[0], minor=TF_VERSION[1])
            + f" ({e})"
        ) from e
    if str(version).startswith("3"):
        raise ImportError(
            _KERAS3_HELP.format(tf=tf.__version__, major=TF_VERSION[0], minor=TF_VERSION[1])
            + f" (tf.keras is Keras {version}"
            + (": TF_USE_LEGACY_KERAS was set after tf.keras was first used; set it in the "
               "environment before starting Python.)" if _legacy_flag_set() else ".)")
        )
    return keras_module


keras = _resolve_keras()
KERAS_PACKAGE = keras.layers.Layer.__module__.split(".")[0]
KERAS_VERSION = getattr(sys.modules.get(KERAS_PACKAGE), "__version__", "unknown")
HAS_ESTIMATOR = TF_VERSION <= (2, 15)
