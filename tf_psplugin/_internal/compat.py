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
import tempfile
import warnings

from tf_psplugin._internal.cli import cli_module
from tf_psplugin._internal.verbosity import CppLogFilter

# Without TF_CPP_MIN_LOG_LEVEL, TensorFlow's import-time INFO lines are dropped.
_DEFAULT_IMPORT_LOG_LEVEL = 1


def _import_tensorflow():
    """Imports TensorFlow; for the plugin's CLIs, honouring TF_CPP_MIN_LOG_LEVEL.

    A program that imports tf_psplugin gets TensorFlow's import exactly as
    TensorFlow does it: no file descriptor is touched. Only when this process
    is one of the plugin's command-line tools (`cli_module`) and the variable
    is unset are import-time INFO lines (oneDNN, CPU features) dropped and
    warnings and errors kept; set it to 0 to see everything.

    Why: TF 2.21 (measured with tensorflow-cpu 2.21.0 from PyPI, Nov 2026)
    prints its oneDNN and CPU-feature INFO lines through absl logging while it
    is imported, ignoring TF_CPP_MIN_LOG_LEVEL, so every command-line tool of
    the plugin (config, launch, server) opened with TF chatter before its own
    one-line messages. While TF is imported, stderr (fd 2) goes to a
    temporary file; afterwards every line is written back except C++ log
    lines below the requested level and absl's preamble about them. Errors
    and anything else are replayed untouched; with the level unset (0)
    nothing is captured.
    """
    try:
        level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", _DEFAULT_IMPORT_LOG_LEVEL) or 0)
    except ValueError:
        level = 0
    if level < 1 or "tensorflow" in sys.modules or cli_module() is None:
        import tensorflow  # pylint: disable=g-import-not-at-top

        return tensorflow
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import tensorflow  # pylint: disable=g-import-not-at-top
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = _filter_import_log(capture.read().decode("utf-8", "replace"), level)
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
    return tensorflow


def _filter_import_log(text: str, level: int) -> str:
    """`text` without C++ log lines below `level` (0 I, 1 W, 2 E, 3 F) and absl's preamble."""
    keep = CppLogFilter(level)
    return "".join(line for line in text.splitlines(keepends=True) if keep(line))


tf = _import_tensorflow()

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


# The newest TensorFlow minor the whole suite ran on (make test-tflatest).
LAST_TESTED_TF = (2, 21)
# Set to 1 to import tf_psplugin on a newer TensorFlow anyway (with a warning).
ALLOW_UNTESTED_TF_ENV = "TF_PSPLUGIN_ALLOW_UNTESTED_TF"


def _check_tf_version() -> None:
    """Raises ImportError for TF outside 2.15..LAST_TESTED_TF (newer: unless allowed)."""
    tested = "{}.{}".format(*LAST_TESTED_TF)
    if TF_VERSION < (2, 15):
        raise ImportError(
            f"tf_psplugin supports TensorFlow 2.15 to {tested}; found {tf.__version__}. "
            "Fix: `pip install 'tensorflow-cpu==2.15.1' 'numpy<2'`."
        )
    if TF_VERSION[0] != 2 or TF_VERSION > LAST_TESTED_TF:
        message = (
            f"tf_psplugin was tested with TensorFlow 2.15 to {tested}; found {tf.__version__}, "
            "whose distribute internals the plugin subclasses have not been checked "
            "(tf_psplugin/_internal/tf_internal.py lists them).")
        if os.environ.get(ALLOW_UNTESTED_TF_ENV, "0").lower() in ("1", "true"):
            warnings.warn(message + f" Running anyway because {ALLOW_UNTESTED_TF_ENV} is set.",
                          RuntimeWarning, stacklevel=3)
            return
        raise ImportError(
            message + f" Fix: `pip install 'tensorflow-cpu=={tested}.*' 'tf-keras=={tested}.*'`, "
            f"or set {ALLOW_UNTESTED_TF_ENV}=1 to try this version anyway.")


def _legacy_flag_set() -> bool:
    return os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in ("1", "true")


def _resolve_keras():
    """Returns the Keras 2 module behind `tf.keras`, or raises ImportError."""
    _check_tf_version()
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
