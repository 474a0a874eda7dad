"""Private TensorFlow/Keras API is reached only through tf_psplugin/_tf_internal.py.

A TF upgrade then has one file to audit (issue 17). The scan reads every
module of the package: any import of `tensorflow.python`, `keras.src` or
`tf_keras.src`, any `tf.__internal__` attribute, and any `importlib`
import elsewhere fails the test with the file and line.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "tf_psplugin")
ADAPTER = "_tf_internal.py"
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
              "from tf_psplugin._tf_internal import context\n")
    assert sorted(line for line, _ in private_uses(source)) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("relpath,path", sorted(m for m in _modules() if m[0] != ADAPTER))
def test_no_private_tf_api_outside_the_adapter(relpath, path):
    with open(path, encoding="utf-8") as f:
        uses = private_uses(f.read())
    assert not uses, (
        f"tf_psplugin/{relpath} uses private TF/Keras API directly: {uses}. "
        f"Import it from tf_psplugin/_tf_internal.py, with a comment saying why.")


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
    assert not unused, f"_tf_internal.py exports names nothing uses: {unused}"
