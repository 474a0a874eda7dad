"""Classes change other objects' state through their methods, not their `_private` fields.

Issue 45 (item 2): a read or write of `obj._attr` (or `getattr(obj, "_attr")`)
where `obj` is not `self`/`cls`/`super()` ties one class to another's
insides. Outside `_internal/` (the TF adapter, which exists to do exactly
that to TF's objects) every such use is listed below with why it stays, and
there are at most `BUDGET` of them. A new one fails with its file and line:
add a method or property to the object's class and call it instead.

Counted by the AST, without importing anything: a module's private names
count too (`data._key`), the standard library's public underscore API does
not (`os._exit`, a namedtuple's `_replace`).
"""

import ast
import collections

from tests.unit import package_source
from tests.unit import private_attributes
BUDGET = 20
# Documented public API of the standard library that starts with "_".
STDLIB_PUBLIC = {"_exit", "_replace", "_asdict", "_fields", "_make", "_field_defaults"}

# (module, private name) -> (uses at most, why it stays).
ALLOWED = {
    ("tables/sharded.py", "_logical_value"): (
        2, "the tensor conversion and operator functions registered for the class are its own "
           "code, written as functions because TF registers functions"),
    ("tables/lookups.py", "_logical_value"): (
        1, "tf.identity dispatched to InterleavedShardedVariable: the class's own read, in the "
           "module that registers TF's dispatchers for it"),
    ("tables/lookups.py", "_shape_only_lookup"): (
        1, "tf.nn.embedding_lookup dispatched to the class: its own shape-only path, as above"),
    ("tables/half_precision.py", "_FORWARDED"): (
        1, "the class's own constant, named through the class inside its __getattr__"),
}


def _uses():
    """[(module, line, name, how, code)] outside _internal/."""
    found = []
    for rel, tree in package_source.trees():
        if rel.startswith("_internal/"):
            continue
        for node, name, how in private_attributes.other_object_private_uses(tree):
            if name not in STDLIB_PUBLIC:
                found.append((rel, node.lineno, name, how, ast.unparse(node)))
    return found


def test_private_state_of_other_objects_is_within_the_budget_and_each_use_is_explained():
    uses = _uses()
    counts = collections.Counter((rel, name) for rel, _, name, _, _ in uses)
    offenders = [f"{rel}:{line} {how} {code}" for rel, line, name, how, code in uses
                 if counts[(rel, name)] > ALLOWED.get((rel, name), (0, ""))[0]]
    assert not offenders, (
        "private state of another object used outside _internal/ (add a method or property "
        "to its class and call that, or, if it must stay, list it in ALLOWED with why):\n"
        + "\n".join(offenders))
    assert len(uses) <= BUDGET, f"{len(uses)} uses, budget {BUDGET}: " + "\n".join(
        f"{rel}:{line} {code}" for rel, line, _, _, code in uses)


def test_every_allowed_use_still_exists():
    counts = collections.Counter((rel, name) for rel, _, name, _, _ in _uses())
    stale = {key: (allowed, counts[key]) for key, (allowed, _) in ALLOWED.items()
             if counts[key] < allowed}
    assert not stale, f"ALLOWED counts above what the code has (lower them): {stale}"
    assert sum(allowed for allowed, _ in ALLOWED.values()) <= BUDGET


def test_the_scan_finds_each_kind_of_use():
    source = ("import os\n"
              "class A:\n"
              "    def f(self, other):\n"
              "        self._mine = other._theirs\n"      # reads other's
              "        other._theirs = 1\n"                # sets other's
              "        return super()._g(), getattr(other, '_x'), os._exit\n"
              "def g(obj):\n"
              "    return obj._y\n")
    found = sorted((node.lineno, name, how) for node, name, how in
                   private_attributes.other_object_private_uses(ast.parse(source)))
    assert found == [(4, "_theirs", "reads"), (5, "_theirs", "sets"), (6, "_exit", "reads"),
                     (6, "_x", "reads"), (8, "_y", "reads")]


def test_no_table_is_asked_by_duck_typing():
    # The table protocol (`views`, `stack`, `row_offsets`, `shares_shards`)
    # is declared on InterleavedShardedVariable with defaults (issue 45).
    asked = []
    for rel, tree in package_source.trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in ("views", "stack", "row_offsets", "shares_shards",
                                               "table_stacks", "fuse_lookups")):
                asked.append(f"{rel}:{node.lineno}")
    assert not asked, f"a table or TableHost asked by getattr instead of its protocol: {asked}"
