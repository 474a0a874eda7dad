"""docs/modules.md names every module of the package (the map stays true)."""

import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_module_map_names_every_module():
    with open(os.path.join(ROOT, "docs", "modules.md"), encoding="utf-8") as f:
        text = f.read()
    package = os.path.join(ROOT, "tf_psplugin")
    missing = []
    for root, _, files in os.walk(package):
        rel = os.path.relpath(root, package)
        for name in files:
            if not name.endswith(".py") or name == "__init__.py":
                continue
            if rel == ".":
                if f"`{name}`" not in text:
                    missing.append(name)
            elif rel in ("estimator", "testing"):  # Public packages: named as a whole.
                if f"`{rel}/`" not in text or (rel == "estimator" and f"`{name}`" not in text):
                    missing.append(f"{rel}/{name}")
            elif f"`{rel}/{name}`" not in text:  # A layer: every module by its path.
                missing.append(f"{rel}/{name}")
    assert not missing, f"docs/modules.md does not mention: {missing}"
