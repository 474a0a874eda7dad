"""Private TensorFlow/Keras API is reached only through tf_psplugin/_internal/tf_internal.py.

A TF upgrade then has one file to audit (issue 17).

* Imports: any import of `tensorflow.python`, `keras.src` or `tf_keras.src`,
  any `tf.__internal__` attribute, and any `importlib` import outside the
  adapter fails with the file and line.
* Attributes: every private attribute of a TF/Keras class or module that the
  package reads, sets or overrides (found by `private_attributes.scan`) must
  be registered in `_tf_internal.PRIVATE_ATTRIBUTES` with its owner, and
  every registered name must still exist at its owner in the installed
  TF/Keras (this file runs on TF 2.15 and on the newest TF in CI).
"""

import ast
import os
import re
import sys

import pytest
import tensorflow as tf

from tests.unit import private_attributes

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "tf_psplugin")
ADAPTER = os.path.join("_internal", "tf_internal.py")
PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tf_keras.src")


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PACKAGE), path


def private_uses(source: str):
    """(line, what) for every private TF/Keras name `source` reaches directly."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Attribute) and node.attr == "__internal__":
            found.append((node.lineno, "tf.__internal__"))
            continue
        else:
            continue
        for name in names:
            if name.startswith(PRIVATE_MODULES) or name == "importlib":
                found.append((node.lineno, f"import {name}"))
    return found


def test_the_scan_catches_each_kind_of_private_use():
    source = ("from tensorflow.python.ops import array_ops\n"
              "import tensorflow.python.eager.context\n"
              "from tf_keras.src.engine import training\n"
              "x = tf.__internal__.distribute.ShardedVariable\n"
              "import importlib\n"
              "import tensorflow as tf\n"
              "from tf_psplugin._internal.tf_internal import context\n")
    assert sorted(line for line, _ in private_uses(source)) == [1, 2, 3, 4, 5]


# The patch installer imports each patch's apply function by its
# "tf_psplugin.<module>:<function>" name (test_patches.py checks every name is
# the plugin's own): its one `importlib` use is allowed, nothing else.
IMPORTLIB_ALLOWED = {os.path.join("_internal", "patches.py")}


@pytest.mark.parametrize("relpath,path", sorted(m for m in _modules() if m[0] != ADAPTER))
def test_no_private_tf_api_outside_the_adapter(relpath, path):
    with open(path, encoding="utf-8") as f:
        uses = private_uses(f.read())
    if relpath in IMPORTLIB_ALLOWED:
        uses = [use for use in uses if use[1] != "import importlib"]
    assert not uses, (
        f"tf_psplugin/{relpath} uses private TF/Keras API directly: {uses}. "
        f"Import it from tf_psplugin/_internal/tf_internal.py, with a comment saying why.")


def test_every_adapter_import_is_used_somewhere():
    with open(os.path.join(PACKAGE, ADAPTER), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module.startswith(PRIVATE_MODULES):
            exported.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.FunctionDef):
            exported.add(node.name)
    sources = "".join(open(path, encoding="utf-8").read()
                      for rel, path in _modules() if rel != ADAPTER)
    unused = sorted(name for name in exported if name not in sources)
    assert not unused, f"_internal/tf_internal.py exports names nothing uses: {unused}"


def _package_modules():
    """(dotted name, path) of every module but the adapter."""
    root = os.path.dirname(os.path.abspath(PACKAGE))
    return sorted((os.path.relpath(path, root)[:-3].replace(os.sep, ".").replace(".__init__", ""),
                   path) for rel, path in _modules() if rel != ADAPTER)


# Keras modules whose private names the plugin touches (reached through
# `_tf_internal.keras_private_module`).
_KERAS_MODULES = ("engine.training", "callbacks", "engine.data_adapter",
                  "optimizers.optimizer", "optimizers.legacy.optimizer_v2",
                  "engine.functional", "engine.node")


def _tf_modules():
    from tf_psplugin._internal import tf_internal as _tf_internal  # pylint: disable=g-import-not-at-top

    modules = [m for m in vars(_tf_internal).values()
               if hasattr(m, "__name__") and type(m) is type(os)
               and m.__name__.startswith(private_attributes.TF_PREFIXES)]
    return modules + [_tf_internal.keras_private_module(n) for n in _KERAS_MODULES]


def _resolve_owner(owner: str):
    from tf_psplugin._internal import tf_internal as _tf_internal  # pylint: disable=g-import-not-at-top

    if owner.startswith("keras:"):
        path = owner[len("keras:"):].split(".")
        for cut in range(len(path), 0, -1):
            try:
                obj = _tf_internal.keras_private_module(".".join(path[:cut]))
            except ImportError:
                continue
            rest = path[cut:]
            break
        else:
            raise ImportError(owner)
    elif owner.startswith("tf:"):
        obj, rest = tf, owner[len("tf:"):].split(".")
    else:
        first, *rest = owner.split(".")
        obj = getattr(_tf_internal, first)
    for part in rest:
        obj = getattr(obj, part)
    return obj


def test_every_private_tf_attribute_is_registered():
    from tf_psplugin._internal import tf_internal as _tf_internal  # pylint: disable=g-import-not-at-top

    flagged = private_attributes.scan(_package_modules(), _tf_modules())
    missing = {name: sorted(f"{os.path.relpath(p, PACKAGE)}:{line} {how}" for p, line, how in uses)
               for name, uses in flagged.items() if name not in _tf_internal.PRIVATE_ATTRIBUTES}
    assert not missing, (
        "private TF/Keras attributes used but not registered in "
        f"_tf_internal.PRIVATE_ATTRIBUTES (add each with its owner and why): {missing}")


def test_every_registered_attribute_is_still_used():
    from tf_psplugin._internal import tf_internal as _tf_internal  # pylint: disable=g-import-not-at-top

    sources = "".join(open(path, encoding="utf-8").read() for _, path in _package_modules())
    stale = sorted(name for name in _tf_internal.PRIVATE_ATTRIBUTES
                   if not re.search(r"(\.|def |[\"'])" + re.escape(name) + r"\b", sources))
    assert not stale, f"PRIVATE_ATTRIBUTES lists names nothing uses any more: {stale}"


def _registered():
    from tf_psplugin._internal import tf_internal as _tf_internal  # pylint: disable=g-import-not-at-top

    return sorted(_tf_internal.PRIVATE_ATTRIBUTES.items())


@pytest.mark.parametrize("name,owner", _registered())
def test_registered_attribute_exists_in_the_installed_tf(name, owner):
    target = _resolve_owner(owner)
    assert private_attributes.defines(target, name), (
        f"TF {tf.__version__} no longer defines {name} at {owner}: the plugin code that "
        f"uses it (grep {name} tf_psplugin) must be ported to this TF version.")


def test_the_attribute_scan_catches_each_kind_of_use(tmp_path, monkeypatch):
    (tmp_path / "scan_probe.py").write_text(
        "import tensorflow as tf\n"
        "class Saver(tf.train.Checkpoint):\n"
        "    def _write(self, prefix, options=None):\n"      # overrides TF's
        "        self._my_own = 1\n"                          # the probe's own
        "        return super()._write(prefix, options=options)\n"
        "def peek(closure, model):\n"
        "    model._should_use_with_coordinator = True\n"     # sets TF's
        "    return closure._function, getattr(closure, '_args'), closure._mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tf_psplugin._internal import tf_internal as _tf_internal  # pylint: disable=g-import-not-at-top

    flagged = private_attributes.scan(
        [("scan_probe", str(tmp_path / "scan_probe.py"))],
        [_tf_internal.cluster_coordinator, _tf_internal.parameter_server_strategy_v2])
    found = {name: sorted({how for _, _, how in uses}) for name, uses in flagged.items()}
    sys.modules.pop("scan_probe", None)
    assert found == {"_write": ["overrides"], "_function": ["reads"], "_args": ["reads"],
                     "_should_use_with_coordinator": ["sets"]}


# -- issue 33: private attributes of other objects only through the adapter --

INTERNAL = "_internal" + os.sep
TF_OBJECTS = os.path.join("_internal", "tf_objects.py")
# Not yet moved to `_internal/tf_objects.py`, with the reason (none left).
OTHER_OBJECT_USES_ALLOWED = {}


def _outside_internal():
    return [(dotted, path) for dotted, path in _package_modules()
            if not os.path.relpath(path, PACKAGE).startswith(INTERNAL)
            and os.path.relpath(path, PACKAGE) not in OTHER_OBJECT_USES_ALLOWED]


def test_private_tf_attributes_of_other_objects_only_through_the_adapter():
    flagged = private_attributes.other_object_uses(_outside_internal(), _tf_modules())
    uses = sorted(f"{os.path.relpath(p, PACKAGE)}:{line} {how} {name}"
                  for name, found in flagged.items() for p, line, how in found)
    assert not uses, (
        "private TF/Keras attributes read or set on objects other than self/cls outside "
        f"_internal/: {uses}. Add a named function to tf_psplugin/_internal/tf_objects.py "
        "(the TF class, why, the TF versions checked) and call it instead.")


def test_the_exempt_modules_exist():
    for relpath in OTHER_OBJECT_USES_ALLOWED:
        assert os.path.exists(os.path.join(PACKAGE, relpath)), relpath


def test_the_other_object_check_catches_each_kind_of_use(tmp_path, monkeypatch):
    (tmp_path / "other_probe.py").write_text(
        "import tensorflow as tf\n"
        "class Saver(tf.train.Checkpoint):\n"
        "    def _write(self, prefix, options=None):\n"   # a subclass's own: allowed
        "        self._args = 1\n"
        "        later = lambda: self._function\n"           # still self: allowed
        "        return super()._write(prefix, options=options)\n"
        "    @classmethod\n"
        "    def make(cls):\n"
        "        return cls._kwargs\n"                        # a classmethod's cls: allowed
        "def peek(closure):\n"
        "    return closure._function, getattr(closure, '_args'), closure._mine\n"
        "def patch(cls):\n"                                  # a patched TF class
        "    cls._concrete_function = None\n"
        "    def _replacement(self):\n"                       # self: a TF object
        "        return self._output_type_spec\n"
        "    return _replacement\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tf_psplugin._internal import tf_internal as _tf_internal  # pylint: disable=g-import-not-at-top

    flagged = private_attributes.other_object_uses(
        [("other_probe", str(tmp_path / "other_probe.py"))], [_tf_internal.cluster_coordinator])
    found = sorted((line, how, name) for name, uses in flagged.items() for _, line, how in uses)
    sys.modules.pop("other_probe", None)
    assert found == [(11, "reads", "_args"), (11, "reads", "_function"),
                     (13, "sets", "_concrete_function"), (15, "reads", "_output_type_spec")]


@pytest.mark.parametrize("module", ["tf_objects", "keras_members"])
def test_every_tf_objects_function_is_used_outside_the_adapter(module):
    with open(os.path.join(PACKAGE, "_internal", module + ".py"), encoding="utf-8") as f:
        defined = [node.name for node in ast.parse(f.read()).body
                   if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    sources = "".join(open(path, encoding="utf-8").read() for rel, path in _modules()
                      if not rel.startswith(INTERNAL))
    unused = sorted(name for name in defined
                    if not re.search(module + r"\." + re.escape(name) + r"\b", sources))
    assert defined and not unused, (
        f"_internal/{module}.py defines functions nothing uses: {unused}")
