"""The package's source files, read without importing them (for the static checks).

Used by test_private_state.py and test_import_names.py.
"""

import ast
import os
from typing import Iterator, Set, Tuple

PACKAGE = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "tf_psplugin"))


def files() -> Iterator[Tuple[str, str]]:
    """(path relative to the package with "/" separators, path) of every module, sorted."""
    for root, dirs, names in os.walk(PACKAGE):
        dirs.sort()
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PACKAGE).replace(os.sep, "/"), path


def trees() -> Iterator[Tuple[str, ast.Module]]:
    """(relative path, parsed module) of every module."""
    for rel, path in files():
        with open(path, encoding="utf-8") as f:
            yield rel, ast.parse(f.read())


def module_names() -> Set[str]:
    """Every module's dotted name (a package by its own name, not `.__init__`)."""
    names = set()
    for rel, _ in files():
        dotted = "tf_psplugin." + rel[:-3].replace("/", ".")
        names.add(dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted)
    return names
