"""The code in README.md, docs/*.md and the public docstrings stays true to the package.

What is checked, for every ```python block of the Markdown files and every
indented example in the docstrings of the public API (`tf_psplugin.__all__`
and the public modules):

* it compiles (a block is compiled inside a function, so an example that
  ends with `return`, as a `main()` body would, is fine);
* every `tf_psplugin.<name>[.<name>...]` it uses exists;
* every call of a public callable passes only arguments its signature takes;
* a block that *documents* a signature (one call, keyword arguments only,
  as `tf_psplugin.X(a=1, b=None)` in docs/api.md) lists exactly the
  callable's parameters with their real defaults.

The examples that need a running cluster run in the cluster tests (the
README's first model is `keras_examples/first_model.py`, checked here to be
the same code and run by tests/cluster/test_examples.py); this test keeps
the rest from drifting.
"""

import ast
import glob
import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin._internal import compat as _compat
from tf_psplugin._internal import deprecation as _deprecation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PUBLIC_MODULES = ("config", "server", "launch", "elastic", "layers", "data")
# Google-style docstring sections: their indented lines are prose, not code.
GOOGLE_SECTIONS = {"Args:", "Arguments:", "Returns:", "Raises:", "Attributes:", "Yields:"}
# Parameters a signature listing may leave out: injection points for tests,
# described in the callable's docstring.
UNDOCUMENTED_IN_LISTINGS = {"clock"}


def _fenced_blocks(text, where, first_line=1):
    """(where:line, code) of every ```python block in `text`."""
    block, start = None, 0
    for number, line in enumerate(text.splitlines(), first_line):
        if block is None and line.strip() == "```python":
            block, start = [], number + 1
        elif block is not None and line.strip() == "```":
            yield f"{where}:{start}", textwrap.dedent("\n".join(block))
            block = None
        elif block is not None:
            block.append(line)


def _markdown_blocks():
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += [os.path.join(ROOT, "deploy", "README.md"),
              os.path.join(ROOT, "benchmarks", "README.md")]
    for path in files:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        # A page's examples read in order: a submodule imported by an earlier
        # block (`import tf_psplugin.estimator`) is there for later ones.
        imports = []
        for where, code in _fenced_blocks(text, os.path.relpath(path, ROOT)):
            yield where, "\n".join(imports + [code])
            imports += [line for line in code.splitlines()
                        if line.startswith("import tf_psplugin.") and line not in imports]


def _public_objects():
    for name in tf_psplugin.__all__:
        yield f"tf_psplugin.{name}", getattr(tf_psplugin, name)
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(f"tf_psplugin.{module_name}")
        yield f"tf_psplugin.{module_name}", module
        for name in getattr(module, "__all__", []):
            yield f"tf_psplugin.{module_name}.{name}", getattr(module, name)


def _docstring_blocks():
    """The usage examples of public docstrings.

    Fenced ```python blocks, and indented blocks that use `tf_psplugin.`
    (module docstrings show their example indented); shell lines
    (`python -m ...`) are not Python and are left out.
    """
    for qualname, obj in _public_objects():
        doc = inspect.getdoc(obj) if inspect.ismodule(obj) or callable(obj) else None
        if not doc:
            continue
        yield from _fenced_blocks(doc, f"docstring of {qualname}")
        unfenced = "\n".join(part for i, part in enumerate(doc.split("```")) if i % 2 == 0)
        block, header = [], ""
        for line in unfenced.splitlines() + [""]:
            if line.startswith("    ") or (block and not line.strip()):
                block.append(line)
                continue
            code = textwrap.dedent("\n".join(block)).strip()
            block = []
            if ("tf_psplugin." in code and not code.startswith(("python ", "$ "))
                    and header.strip() not in GOOGLE_SECTIONS):
                yield f"docstring of {qualname}", code
            if line.strip():
                header = line


def _attributes_after_import():
    """Names `import tf_psplugin` alone defines (a fresh process: this one imported more)."""
    out = subprocess.run(
        [sys.executable, "-c", "import json, tf_psplugin; print(json.dumps(dir(tf_psplugin)))"],
        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300,
        check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


ATTRIBUTES_AFTER_IMPORT = _attributes_after_import()
BLOCKS = list(_markdown_blocks()) + list(_docstring_blocks())


def _resolve(node, imported=()):
    """The object a `tf_psplugin.a.b` expression names, (obj, dotted) or (None, None).

    `imported`: submodules the example imports itself (`import tf_psplugin.x`).
    """
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "tf_psplugin"):
        return None, None
    obj, dotted = tf_psplugin, "tf_psplugin"
    for i, part in enumerate(reversed(parts)):
        dotted += "." + part
        if i == 0 and part not in ATTRIBUTES_AFTER_IMPORT and part not in imported:
            raise AssertionError(
                f"{dotted} does not exist after `import tf_psplugin` "
                f"(AttributeError unless `import {dotted}` comes first)")
        if not hasattr(obj, part) and part in imported:
            obj = importlib.import_module(dotted)
            continue
        if not hasattr(obj, part):
            raise AssertionError(f"{dotted} does not exist")
        obj = getattr(obj, part)
    return obj, dotted


def _signature(obj):
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def test_markdown_and_docstrings_have_examples():
    # The extraction itself must find the examples, or the checks below are empty.
    where = {w.split(":")[0] for w, _ in BLOCKS}
    assert "README.md" in where and "docs/api.md" in where
    assert any(w.startswith("docstring of") for w, _ in BLOCKS)


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_example_compiles_and_uses_the_real_api(where, code):
    if "tf_psplugin.estimator" in code and not _compat.HAS_ESTIMATOR:
        pytest.skip("the Estimator front-end needs TF 2.15 (tf.estimator was removed in 2.16); "
                    "the TF 2.15 run checks this example")
    source = "def _example():\n" + textwrap.indent(code, "    ") + "\n"
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        pytest.fail(f"{where}: does not compile: {e}")
    problems = []
    imported = {alias.name.split(".")[1] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names
                if alias.name.startswith("tf_psplugin.")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            try:
                _resolve(node, imported)
            except AssertionError as e:
                problems.append(str(e))
        if isinstance(node, ast.Call):
            try:
                obj, dotted = _resolve(node.func, imported)
            except AssertionError:
                continue
            sig = _signature(obj) if obj is not None else None
            if sig is None:
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(
                    k.arg is None for k in node.keywords):
                continue
            try:
                bound = sig.bind_partial(*[None] * len(node.args),
                                         **{k.arg: None for k in node.keywords})
            except TypeError as e:
                problems.append(f"{dotted}(...): {e}")
                continue
            # The strategy's `**knobs` take the fields of HybridOptions only.
            knobs = bound.arguments.get("knobs", {}) if "knobs" in sig.parameters else {}
            unknown = sorted(set(knobs) - set(tf_psplugin.HybridOptions.__dataclass_fields__))
            if unknown:
                problems.append(f"{dotted}(...): {unknown} are not HybridOptions knobs")
    assert not problems, f"{where}: " + "; ".join(sorted(set(problems)))


def _documented_signatures():
    for where, code in BLOCKS:
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.Expr, ast.Assign)):
            continue
        call = tree.body[0].value  # `X(...)` or `config = X(...)`
        if not isinstance(call, ast.Call) or not call.keywords or not all(
                isinstance(a, ast.Name) for a in call.args) or any(
                isinstance(k.value, ast.Name) for k in call.keywords):
            continue
        if "tf_psplugin.estimator" in code and not _compat.HAS_ESTIMATOR:
            continue  # Checked by the TF 2.15 run: the module raises ImportError here.
        imported = {"estimator"} if "tf_psplugin.estimator" in code else set()
        obj, dotted = _resolve(call.func, imported)
        if obj is not None:
            yield where, dotted, obj, call


SIGNATURE_BLOCKS = list(_documented_signatures())


def test_the_api_reference_documents_signatures():
    assert len(SIGNATURE_BLOCKS) >= 5, [d for _, d, _, _ in SIGNATURE_BLOCKS]


@pytest.mark.parametrize("where,dotted,obj,call", SIGNATURE_BLOCKS,
                         ids=[f"{w} {d}" for w, d, _, _ in SIGNATURE_BLOCKS])
def test_documented_signature_is_the_real_one(where, dotted, obj, call):
    params = {name: p for name, p in _signature(obj).parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
              and not name.startswith("_") and name not in UNDOCUMENTED_IN_LISTINGS
              and p.default is not _deprecation.UNSET}  # Former names: in the prose.
    positional = [a.id for a in call.args]
    assert positional == list(params)[:len(positional)], (
        f"{where}: {dotted}: documented positional parameters {positional}, "
        f"code's {list(params)[:len(positional)]}")
    params = {n: p for n, p in params.items() if n not in positional}
    documented = {k.arg: k.value for k in call.keywords if k.arg is not None}
    assert list(documented) == [n for n in params if n in documented], (
        f"{where}: {dotted}: documented order {list(documented)} is not the code's")
    assert set(documented) == set(params), (
        f"{where}: {dotted}: documented parameters {sorted(documented)}, "
        f"code has {sorted(params)}")
    namespace = {"tf": tf}
    for name, value_node in documented.items():
        documented_value = eval(compile(ast.Expression(value_node), where, "eval"), namespace)
        actual = params[name].default
        assert actual is not inspect.Parameter.empty, f"{where}: {dotted}: {name} has no default"
        assert documented_value == actual, (
            f"{where}: {dotted}: {name} documented as {documented_value!r}, "
            f"code's default is {actual!r}")


def test_the_readmes_first_model_is_the_example_ci_runs():
    """README's first ```python block is keras_examples/first_model.py after its docstring."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        _, first_block = next(_fenced_blocks(f.read(), "README.md"))
    with open(os.path.join(ROOT, "keras_examples", "first_model.py"), encoding="utf-8") as f:
        script = f.read()
    body = script[script.index('"""', 3) + len('"""'):].strip()
    assert first_block.strip() == body, (
        "README's first model and keras_examples/first_model.py differ: change both")
    assert "dataset = " in body and "ChiefCheckpoint(" in body
