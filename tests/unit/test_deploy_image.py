"""deploy/Dockerfile, .dockerignore, setup.cfg and the TFJob manifest agree.

Docker is not needed (and not assumed): these read the files. What they
guard is what would break a user's `docker build` or make the image differ
from what the manifest runs: the script the manifest's command names must be
in the image at its working directory, the files `pip install .` reads must
be in the build context, and the pinned dependencies must be setup.cfg's.
"""

import configparser
import os
import re
import shlex

import pytest

pytest.importorskip("yaml", reason="PyYAML (test extra) parses the manifest")

from tests._tfjob import REPO_ROOT, container, load_manifest  # noqa: E402

DOCKERFILE = os.path.join(REPO_ROOT, "deploy", "Dockerfile")
DOCKERIGNORE = os.path.join(REPO_ROOT, ".dockerignore")


def instructions():
    """[(INSTRUCTION, argument text)] with continuation lines joined, comments dropped."""
    with open(DOCKERFILE, encoding="utf-8") as f:
        text = re.sub(r"\\\n", " ", f.read())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def one(name):
    (found,) = [arg for word, arg in instructions() if word == name]
    return found


def setup_cfg():
    parser = configparser.ConfigParser()
    parser.read(os.path.join(REPO_ROOT, "setup.cfg"))
    return parser


def requirement_lines(value):
    return [line.strip() for line in value.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def ignored(path, patterns):
    """Whether .dockerignore's patterns exclude `path` (or a parent directory).

    Docker's rules, as far as this file uses them: patterns are relative to
    the context root, `*` and `?` do not cross `/`, `**` matches any number of
    directories, a later `!pattern` re-includes.
    """
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def dockerignore_patterns():
    with open(DOCKERIGNORE, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def test_ignore_matcher_follows_docker_rules():
    patterns = ["**/__pycache__", ".venv-*", "runs", "docs/*.md", "!docs/keep.md"]
    assert ignored("tf_psplugin/__pycache__/x.pyc", patterns)
    assert ignored("__pycache__", patterns) and ignored(".venv-tflatest/bin/python", patterns)
    assert ignored("runs/demo/ckpt", patterns) and ignored("docs/api.md", patterns)
    assert not ignored("docs/keep.md", patterns) and not ignored("docs/sub/a.md", patterns)
    assert not ignored("tf_psplugin/runs.py", patterns) and not ignored(".venv", patterns)


def test_python_and_dependencies_match_setup_cfg():
    base = one("FROM")
    version = re.match(r"python:(\d+)\.(\d+)", base)
    assert version, f"base image {base!r} is not an official python image"
    cfg = setup_cfg()
    minimum = tuple(int(x) for x in re.search(r">=\s*(\d+)\.(\d+)",
                                              cfg["options"]["python_requires"]).groups())
    python = tuple(int(x) for x in version.groups())
    assert minimum <= python <= (3, 11), "TF 2.15 has wheels for Python 3.9-3.11"

    runs = [shlex.split(arg) for word, arg in instructions() if word == "RUN"]
    deps = [argv for argv in runs if argv[:2] == ["pip", "install"] and "." not in argv
            and not any(a.startswith(".[") for a in argv)]
    assert len(deps) == 1, runs
    pinned = sorted(a for a in deps[0][2:] if not a.startswith("-"))
    expected = sorted(requirement_lines(cfg["options"]["install_requires"])
                      + requirement_lines(cfg["options.extras_require"]["tf215"]))
    assert pinned == expected, "the Dockerfile's dependency layer must be setup.cfg's"
    assert any(r.startswith("tensorflow-cpu==2.15") for r in expected)

    (package,) = [argv for argv in runs if argv[:2] == ["pip", "install"] and argv is not deps[0]]
    assert ".[tf215]" in package, "install the package itself with the same extra"


def test_image_holds_what_the_manifest_runs():
    copy = shlex.split(one("COPY"))
    workdir = one("WORKDIR")
    assert copy == [".", workdir], "the whole checkout goes to the working directory"
    patterns = dockerignore_patterns()
    # pip install . reads these (README.md is setup.cfg's long_description).
    for needed in ("setup.cfg", "pyproject.toml", "README.md", "tf_psplugin/__init__.py",
                   "tf_psplugin/_version.py"):
        assert os.path.exists(os.path.join(REPO_ROOT, needed)), needed
        assert not ignored(needed, patterns), f".dockerignore drops {needed}"

    cmd = shlex.split(one("CMD").replace("[", "").replace("]", "").replace(",", " "))
    specs = load_manifest()["TFJob"]["spec"]["tfReplicaSpecs"]
    for rtype, spec in specs.items():
        c = container(spec)
        assert c["workingDir"] == workdir, rtype
        assert c["command"] == cmd, f"{rtype}: the image's default command is the manifest's"
        assert c["command"][0] == "python"  # The base image's interpreter, with the package.
        script = c["command"][1]
        assert os.path.isfile(os.path.join(REPO_ROOT, script)), script
        assert not ignored(script, patterns), script
        # The script is self-contained: it imports nothing from its own directory.
        with open(os.path.join(REPO_ROOT, script), encoding="utf-8") as f:
            assert "sys.path" not in f.read(), script
        ports = [p["containerPort"] for p in c.get("ports", []) if p["name"] == "tfjob-port"]
        assert ports == [int(one("EXPOSE"))], rtype


def test_dockerignore_keeps_local_environments_out():
    patterns = dockerignore_patterns()
    for path in (".venv/bin/python", ".venv-tflatest/bin/python", ".git/HEAD",
                 "tf_psplugin/__pycache__/config.cpython-311.pyc", "runs/demo/ckpt-1.index"):
        assert ignored(path, patterns), path
