"""Finds the private TF/Keras attributes a package reads, sets or overrides.

Used by test_tf_internal.py. Static analysis cannot know every object's type,
so a private name `_x` counts as TensorFlow's when:

* a class of the package has a TF/Keras ancestor that defines `_x` (as a
  class attribute, a method, or `self._x` in its source), and the class
  overrides it (`def _x`) or reads or sets `self._x`; or
* `_x` is defined by such an ancestor or by one of the TF/Keras modules the
  adapter names, and the package reads or sets it on any object other than
  `self`/`cls`/`super()` (`closure._function`, `getattr(x, "_x")`,
  `training._get_verbosity = ...`).

What it cannot see: a TF private name read through `self` in a function
outside any class, or in a class whose bases cannot be resolved at import
time. Those are registered by hand in `_tf_internal.PRIVATE_ATTRIBUTES` like
every other name.
"""

import ast
import collections
import importlib
import inspect
import re

TF_PREFIXES = ("tensorflow.", "keras.", "tf_keras.")
_DEF_OR_ATTR = re.compile(r"(?:def |\.)(_[A-Za-z]\w*)")
_MODULE_ASSIGN = re.compile(r"^\s*(_[A-Za-z]\w*)\s*=", re.M)
_ATTR_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_tf_class(cls) -> bool:
    return (getattr(cls, "__module__", "") or "").startswith(TF_PREFIXES)


_SOURCE_NAMES = {}


def source_names(obj) -> set:
    """Private names `obj`'s source defines or touches (`def _x`, `._x`, `_x =`)."""
    key = id(obj)
    if key not in _SOURCE_NAMES:
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            source = ""
        _SOURCE_NAMES[key] = (set(_DEF_OR_ATTR.findall(source))
                              | set(_MODULE_ASSIGN.findall(source)))
    return _SOURCE_NAMES[key]


def tf_ancestor_names(cls) -> set:
    names = set()
    for base in cls.__mro__:
        if is_tf_class(base):
            names |= {n for n in vars(base) if is_private(n)} | source_names(base)
    return names


def defines(owner, name: str) -> bool:
    """Whether TF/Keras `owner` (class or module) still has private `name`."""
    if inspect.ismodule(owner):
        return name in vars(owner)
    if hasattr(owner, name):
        return True
    return any(name in source_names(base) for base in owner.__mro__ if is_tf_class(base))


def scan(modules, tf_modules):
    """{name: [(path, line, "reads"|"sets"|"overrides")]} of TF private names.

    Args:
      modules: (dotted module name, file path) of the package's modules.
      tf_modules: TF/Keras modules whose private names count as TF's.
    """
    tf_names = set()
    for module in tf_modules:
        tf_names |= source_names(module)
    flagged = collections.defaultdict(list)
    parsed = []
    for dotted, path in modules:
        try:
            module = importlib.import_module(dotted)
        except ImportError:  # e.g. tf_psplugin.estimator on TF >= 2.16.
            module = None
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        parsed.append((path, tree))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(module, node.name, None) if module is not None else None
            inherited = tf_ancestor_names(cls) if inspect.isclass(cls) else set()
            tf_names |= inherited
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef) and item in node.body:
                    name, how = item.name, "overrides"
                elif (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name)
                      and item.value.id == "self"):
                    name = item.attr
                    how = "sets" if isinstance(item.ctx, ast.Store) else "reads"
                else:
                    continue
                if is_private(name) and name in inherited:
                    flagged[name].append((path, item.lineno, how))
    for path, tree in parsed:
        for node in ast.walk(tree):
            name, how = _other_object_use(node)
            if name is not None and name in tf_names:
                flagged[name].append((path, node.lineno, how))
    return flagged


def other_object_uses(modules, tf_modules):
    """{name: [(path, line, "reads"|"sets")]}: TF private names used on other objects.

    Stricter than `scan` about `self` and `cls`: they count as the object
    itself only in a function defined in a class body (a method) and in the
    functions and lambdas nested in it; a module-level function's `cls`
    (a Keras class it patches) or the `self` of a replacement method defined
    inside a function (the Keras object it runs on) is another object.

    Args:
      modules: (dotted module name, file path) of the modules to check.
      tf_modules: TF/Keras modules whose private names count as TF's.
    """
    tf_names = set(_tf_names(modules, tf_modules))
    flagged = collections.defaultdict(list)
    for _, path in modules:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node, own in _walk_with_own_names(tree, frozenset()):
            name, how = _other_object_use(node, own)
            if name is not None and name in tf_names:
                flagged[name].append((path, node.lineno, how))
    return flagged


def _tf_names(modules, tf_modules):
    """The private names `scan` counts as TF's for these modules."""
    names = set()
    for module in tf_modules:
        names |= source_names(module)
    for dotted, path in modules:
        try:
            module = importlib.import_module(dotted)
        except ImportError:  # e.g. tf_psplugin.estimator on TF >= 2.16.
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                cls = getattr(module, node.name, None)
                if inspect.isclass(cls):
                    names |= tf_ancestor_names(cls)
    return names


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _walk_with_own_names(node, own, in_class=False):
    """(node, names that mean the object itself there) for `node` and below."""
    yield node, own
    if isinstance(node, ast.ClassDef):
        for child in ast.iter_child_nodes(node):
            yield from _walk_with_own_names(child, own, in_class=True)
        return
    if isinstance(node, _FUNCTIONS):
        params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        if in_class and not isinstance(node, ast.Lambda):
            own = frozenset({"self", "cls"})
        else:
            own = own - params  # A parameter named self/cls here is some other object.
    for child in ast.iter_child_nodes(node):
        yield from _walk_with_own_names(child, own)


def _other_object_use(node, own=("self", "cls")):
    """(name, how) for `x._name` / getattr(x, "_name") with x not self/cls/super()."""
    if isinstance(node, ast.Attribute) and is_private(node.attr):
        value = node.value
        if isinstance(value, ast.Name) and value.id in own:
            return None, None
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id == "super"):
            return None, None
        return node.attr, "sets" if isinstance(node.ctx, ast.Store) else "reads"
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _ATTR_FUNCTIONS and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in own
                     and node.args[0].id == "self")):
        return node.args[1].value, "sets" if node.func.id in ("setattr", "delattr") else "reads"
    return None, None


def other_object_private_uses(tree):
    """(node, name, how) for every private name `tree` reads or sets on an object not its own.

    Any private name, the package's own too (`other_object_uses` keeps TF's).
    "Own" as in `other_object_uses`: `self`/`cls` in a method, `super()`.
    """
    for node, own in _walk_with_own_names(tree, frozenset()):
        name, how = _other_object_use(node, own)
        if name is not None:
            yield node, name, how
