"""The version gate (`tf_psplugin._internal.compat`): Keras 2 or a clear ImportError.

`make test` runs this file in both CI environments, and each covers
something different. Be precise about which:

* TF 2.15 env (`.venv`): Keras 2 is built in, so the real import succeeds
  with or without `TF_USE_LEGACY_KERAS`... unless that variable points
  `tf.keras` at a tf-keras package that is not installed (checked for real
  below). Keras 3 cannot occur there, so its error is only *simulated*
  (monkeypatched TF version, environment and `tf.keras`).
* Newest-TF env (`.venv-tflatest`, TF 2.21 + tf-keras, run with
  `TF_USE_LEGACY_KERAS=1`): a fresh process *without* the variable really
  gets Keras 3 and must raise the clear ImportError; with it, `tf.keras` must
  be tf-keras of the same minor version.

The simulated tests run in both environments. Tests that only make sense in
one environment are skipped in the other with a reason that says so.
"""

import json
import os
import re
import subprocess
import sys
import types

import pytest
import tensorflow as tf

from tf_psplugin._internal import compat as _compat

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TF_MINOR = tuple(int(p) for p in tf.__version__.split(".")[:2])
NEW_TF = TF_MINOR >= (2, 16)

PROBE = (
    "import json, tf_psplugin\n"
    "from tf_psplugin import _compat\n"
    "print(json.dumps([_compat.KERAS_PACKAGE, str(_compat.KERAS_VERSION)]))\n"
)


def import_in_fresh_process(legacy_flag):
    """Imports tf_psplugin in a new interpreter; returns CompletedProcess."""
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    if legacy_flag is not None:
        env["TF_USE_LEGACY_KERAS"] = legacy_flag
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)


def last_line(text):
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# -- Real imports in a fresh process ------------------------------------------


@pytest.mark.skipif(not NEW_TF, reason="TF 2.15 has no Keras 3; the real Keras-3 import error "
                    "is checked in the tflatest env (make test); simulated below")
def test_new_tf_without_legacy_flag_raises_clear_import_error():
    result = import_in_fresh_process(legacy_flag=None)
    assert result.returncode != 0, result.stdout
    line = last_line(result.stderr)
    major, minor = TF_MINOR
    assert line.startswith("ImportError: tf_psplugin needs Keras 2: ParameterServerStrategy is "
                           "not supported by Keras 3"), result.stderr
    assert f"TensorFlow {tf.__version__}" in line, line
    assert re.search(rf"pip install '?tf-keras[~=]={major}\.{minor}\b", line), line
    assert "TF_USE_LEGACY_KERAS=1 before TensorFlow is imported" in line, line
    assert "tensorflow-cpu==2.15.1" in line, line
    assert line.endswith("(TF_USE_LEGACY_KERAS is not set.)"), line


@pytest.mark.skipif(not NEW_TF, reason="TF_USE_LEGACY_KERAS selects tf-keras only on TF >= 2.16 "
                    "(runs in the tflatest env)")
@pytest.mark.parametrize("value", ["1", "true"])
def test_new_tf_with_legacy_flag_uses_tf_keras_of_the_same_minor(value):
    result = import_in_fresh_process(legacy_flag=value)
    assert result.returncode == 0, result.stderr
    package, version = json.loads(last_line(result.stdout))
    assert package == "tf_keras", result.stdout
    assert version.split(".")[:2] == tf.__version__.split(".")[:2], result.stdout


@pytest.mark.skipif(NEW_TF, reason="TF 2.15 only: Keras 2.15 is built in there")
def test_tf215_imports_keras2_without_legacy_flag():
    result = import_in_fresh_process(legacy_flag=None)
    assert result.returncode == 0, result.stderr
    package, version = json.loads(last_line(result.stdout))
    assert package == "keras" and version.startswith("2.15"), result.stdout


def _tf_keras_installed():
    import importlib.util

    return importlib.util.find_spec("tf_keras") is not None


@pytest.mark.skipif(NEW_TF or _tf_keras_installed(),
                    reason="TF 2.15 env without tf-keras only")
def test_tf215_with_legacy_flag_but_no_tf_keras_fails_with_import_error():
    # TF 2.15 honours TF_USE_LEGACY_KERAS=1 too and then imports `tf_keras`;
    # a shell that exports the variable for a newer env must not produce an
    # AttributeError deep inside Keras here.
    result = import_in_fresh_process(legacy_flag="1")
    assert result.returncode != 0, result.stdout
    line = last_line(result.stderr)
    assert line.startswith("ImportError: tf_psplugin"), result.stderr
    assert "TF_USE_LEGACY_KERAS" in line and "tf-keras" in line, line


# -- Simulated (monkeypatched) gates: run in both environments -------------------


class _FakeLayer:
    pass


def _fake_tf(version, layer_module=None, keras_error=None):
    """A stand-in for the `tensorflow` module as `_compat` uses it."""

    class FakeTF(types.SimpleNamespace):
        @property
        def keras(self):
            if keras_error is not None:
                raise keras_error
            layer = type("Layer", (), {"__module__": layer_module})
            return types.SimpleNamespace(layers=types.SimpleNamespace(Layer=layer))

    return FakeTF(__version__=version)


def _simulate(monkeypatch, version, legacy_flag, **fake):
    monkeypatch.setattr(_compat, "tf", _fake_tf(version, **fake))
    monkeypatch.setattr(_compat, "TF_VERSION", tuple(int(p) for p in version.split(".")[:2]))
    if legacy_flag is None:
        monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    else:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy_flag)


def test_simulated_keras3_without_legacy_flag(monkeypatch):
    _simulate(monkeypatch, "2.21.0", None, layer_module="keras.src.layers.layer")
    with pytest.raises(ImportError) as info:
        _compat._resolve_keras()  # pylint: disable=protected-access
    message = str(info.value)
    assert message.startswith("tf_psplugin needs Keras 2: ParameterServerStrategy is not "
                              "supported by Keras 3"), message
    assert "TensorFlow 2.21.0" in message, message
    assert re.search(r"pip install '?tf-keras[~=]=2\.21\b", message), message
    assert message.endswith("(TF_USE_LEGACY_KERAS is not set.)"), message
    assert "\n" not in message


@pytest.mark.parametrize("flag", ["0", "false", ""])
def test_simulated_falsy_legacy_flag_counts_as_unset(monkeypatch, flag):
    _simulate(monkeypatch, "2.18.1", flag, layer_module="keras.src.layers.layer")
    with pytest.raises(ImportError, match=r"tf-keras[~=]=2\.18\b.*TF_USE_LEGACY_KERAS is not set"):
        _compat._resolve_keras()  # pylint: disable=protected-access


def test_simulated_keras3_despite_legacy_flag(monkeypatch):
    # E.g. tf.keras was already resolved to Keras 3 before the variable was set.
    fake_keras = types.ModuleType("keras")
    fake_keras.__version__ = "3.15.1"
    monkeypatch.setitem(sys.modules, "keras", fake_keras)
    _simulate(monkeypatch, "2.21.0", "1", layer_module="keras.src.layers.layer")
    with pytest.raises(ImportError, match=r"\(tf\.keras is Keras 3\.15\.1[.:]"):
        _compat._resolve_keras()  # pylint: disable=protected-access


def test_simulated_legacy_flag_without_tf_keras_installed(monkeypatch):
    _simulate(monkeypatch, "2.21.0", "1",
              keras_error=ImportError("Keras cannot be imported. Check that it is installed."))
    with pytest.raises(ImportError) as info:
        _compat._resolve_keras()  # pylint: disable=protected-access
    assert re.search(r"pip install '?tf-keras[~=]=2\.21\b", str(info.value)), info.value
    assert str(info.value).endswith("(Keras cannot be imported. Check that it is installed.)")


def test_simulated_tf_keras_with_legacy_flag_is_accepted(monkeypatch):
    fake_tf_keras = types.ModuleType("tf_keras")
    fake_tf_keras.__version__ = "2.21.0"
    monkeypatch.setitem(sys.modules, "tf_keras", fake_tf_keras)
    _simulate(monkeypatch, "2.21.0", "1", layer_module="tf_keras.src.engine.base_layer")
    keras = _compat._resolve_keras()  # pylint: disable=protected-access
    assert keras.layers.Layer.__module__.startswith("tf_keras.")


def test_simulated_tf_older_than_215_is_rejected(monkeypatch):
    _simulate(monkeypatch, "2.14.1", None, layer_module="keras.src.engine.base_layer")
    with pytest.raises(ImportError, match=r"supports TensorFlow 2\.15 to 2\.21; found 2\.14\.1"):
        _compat._resolve_keras()  # pylint: disable=protected-access


def test_this_environment_resolved_keras_2():
    """Whatever the env, the imported package saw Keras 2 (the gate passed)."""
    assert str(_compat.KERAS_VERSION).startswith("2."), _compat.KERAS_VERSION
    assert _compat.KERAS_PACKAGE == ("tf_keras" if NEW_TF else "keras")
    assert _compat.HAS_ESTIMATOR == (not NEW_TF)


@pytest.mark.parametrize("version", ["2.22.0", "2.30.1", "3.0.0"])
def test_simulated_tf_newer_than_last_tested_is_refused(monkeypatch, version):
    monkeypatch.delenv(_compat.ALLOW_UNTESTED_TF_ENV, raising=False)
    _simulate(monkeypatch, version, "1", layer_module="tf_keras.src.engine.base_layer")
    with pytest.raises(ImportError) as info:
        _compat._resolve_keras()  # pylint: disable=protected-access
    message = str(info.value)
    assert f"tested with TensorFlow 2.15 to 2.21; found {version}" in message, message
    assert "pip install 'tensorflow-cpu==2.21.*' 'tf-keras==2.21.*'" in message, message
    assert f"{_compat.ALLOW_UNTESTED_TF_ENV}=1" in message and "\n" not in message


def test_simulated_newer_tf_allowed_by_the_environment_warns(monkeypatch):
    fake_tf_keras = types.ModuleType("tf_keras")
    fake_tf_keras.__version__ = "2.22.0"
    monkeypatch.setitem(sys.modules, "tf_keras", fake_tf_keras)
    monkeypatch.setenv(_compat.ALLOW_UNTESTED_TF_ENV, "1")
    _simulate(monkeypatch, "2.22.0", "1", layer_module="tf_keras.src.engine.base_layer")
    with pytest.warns(RuntimeWarning, match=r"found 2\.22\.0.*Running anyway"):
        keras = _compat._resolve_keras()  # pylint: disable=protected-access
    assert keras.layers.Layer.__module__.startswith("tf_keras.")


def test_last_tested_tf_is_the_newest_ci_runs():
    # setup.cfg's tflatest extra pins what `make test-tflatest` installs.
    import configparser
    import os as os_lib

    cfg = configparser.ConfigParser()
    cfg.read(os_lib.path.join(os_lib.path.dirname(__file__), "..", "..", "setup.cfg"))
    pins = cfg["options.extras_require"]["tflatest"]
    tested = "{}.{}".format(*_compat.LAST_TESTED_TF)
    assert re.search(rf"tensorflow(-cpu)?\s*==\s*{re.escape(tested)}\b", pins), pins
