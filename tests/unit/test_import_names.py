"""One import name per module: its own name, or its own name plus `_lib` (issue 45).

TF imports `type_spec as type_spec_lib` everywhere, so grep finds every user
of a module by one name. Here each tf_psplugin module imported as a module
inside the package has one name, and that name is the module's own
(`stacking`), its own plus `_lib` (`placement_lib`, where the plain name
is a common variable), either with a leading underscore (`_tf_internal`,
`_compat`: private imports). Read from the source, importing nothing.
"""

import ast
import collections
import os

from tests.unit import package_source
# Files whose import names wait for other work to land, with why.
NOT_YET = {
}


def import_names(tree, modules):
    """(module, name, line) for every import of a package module as a module in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    found.append((full, alias.asname or alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    found.append((alias.name, alias.asname, node.lineno))
    return found


def _names_by_module():
    modules = package_source.module_names()
    names = collections.defaultdict(lambda: collections.defaultdict(list))
    for rel, tree in package_source.trees():
        if rel not in NOT_YET:
            for module, name, line in import_names(tree, modules):
                names[module][name].append(f"{rel}:{line}")
    return names


def _fits(module: str, name: str) -> bool:
    own = module.rsplit(".", 1)[1].lstrip("_")
    return name.lstrip("_") in (own, own + "_lib")


def test_each_module_has_one_import_name_and_it_is_its_own():
    bad = []
    for module, names in sorted(_names_by_module().items()):
        if len({n.lstrip("_") for n in names}) > 1:
            bad.append(f"{module} is imported as {dict((n, w) for n, w in names.items())}")
        bad += [f"{module} imported as {n!r} (use its own name, or name_lib): {w}"
                for n, w in names.items() if not _fits(module, n)]
    assert not bad, "\n".join(bad)


def test_the_exempt_files_exist():
    for rel in NOT_YET:
        assert os.path.exists(os.path.join(package_source.PACKAGE, rel)), f"stale entry: {rel}"


def test_the_check_sees_a_second_name_and_a_foreign_name():
    source = ("from tf_psplugin.tables import stacking as table_stacking\n"
              "from tf_psplugin.tables import placement as placement_lib\n"
              "import tf_psplugin.tables.sharded as sharding\n")
    found = import_names(ast.parse(source), {"tf_psplugin.tables.stacking",
                                             "tf_psplugin.tables.placement",
                                             "tf_psplugin.tables.sharded"})
    assert [(m, n, _fits(m, n)) for m, n, _ in found] == [
        ("tf_psplugin.tables.stacking", "table_stacking", False),
        ("tf_psplugin.tables.placement", "placement_lib", True),
        ("tf_psplugin.tables.sharded", "sharding", False)]
