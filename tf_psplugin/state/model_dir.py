"""The model directory: where checkpoints, markers and evaluation results live.

Why this module exists: in a tf_psplugin job several processes touch one
directory, on possibly different hosts and with different working
directories. The chief decides what is written; the PS tasks write their
shards of every checkpoint *into the same path* (TensorFlow saves each table
shard on the PS that holds it); the evaluator reads checkpoints and writes its
results under ``<model_dir>/eval``. That only works if every process agrees on
one absolute path on a filesystem they all see, so this module:

* resolves the path once on the chief: ``~`` expanded, relative paths made
  absolute against the *chief's* working directory (a PS task resolving
  ``runs/x`` against its own cwd would write somewhere else), remote paths
  (``gs://``, ``hdfs://``, ``s3://``, any ``scheme://``) passed through to
  `tf.io.gfile` unchanged;
* checks it is writable and raises one `ModelDirError` naming the path and the
  fix when it is not (malformed, a file, no permission, unknown filesystem);
* decides which checkpoints in the directory are complete. Checkpoints are
  ``ckpt-<step>``; after TF has written one, the chief writes its commit
  marker ``ckpt-<step>.commit`` (step, input position, size of every file).
  Only checkpoints whose marker exists and whose files all have the recorded
  sizes count (`latest_checkpoint_info`), so a crash in the middle of a save, or
  a file truncated later, never yields a checkpoint that restore would pick;
* decides which incremental checkpoints (deltas) extend the latest complete
  checkpoint: a delta ``delta-<step>`` is a directory whose commit marker
  ``delta-<step>.commit`` names its base ``ckpt-<m>`` and its parent (the
  base or the previous delta). `checkpoint_chain` returns the latest intact
  full checkpoint and its unbroken run of intact deltas; a torn delta ends
  the chain there, as a torn full checkpoint is skipped. Deltas live in their
  own namespace, so `latest_checkpoint_info` and every tool that reads full
  checkpoints (evaluator, export, stock TF) never see them;
* writes ``TRAINING_DONE`` (the final step; the evaluator's exit signal).
  Markers are written atomically (temp file + rename) on local filesystems.
"""

import dataclasses
import glob as glob_lib
import json
import os
import re
import time
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence

import tensorflow as tf
from absl import logging

from tf_psplugin.cluster import config as config_lib
from tf_psplugin.errors import CheckpointError, ModelDirError  # noqa: F401  (see errors.py)

__all__ = [
    "CHECKPOINT_NAME",
    "COMMIT_SUFFIX",
    "CheckpointError",
    "CheckpointInfo",
    "EVAL_SUBDIR",
    "TRAINING_DONE",
    "ModelDirError",
    "DELTA_NAME",
    "checkpoint_chain",
    "clear_training_done",
    "commit_delta",
    "drop_orphan_deltas",
    "list_deltas",
    "ensure_writable",
    "is_chief_task",
    "is_remote",
    "join",
    "latest_checkpoint_info",
    "list_checkpoints",
    "read_json",
    "read_training_done",
    "resolve",
    "resolve_checkpoint",
    "verify_checkpoint",
    "write_json_atomic",
    "write_training_done",
]

TRAINING_DONE = "TRAINING_DONE"
EVAL_SUBDIR = "eval"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_remote(path: str) -> bool:
    """True for ``scheme://...`` paths other than ``file://`` (gs, hdfs, s3, ...)."""
    match = _SCHEME.match(path)
    return bool(match) and match.group(1).lower() != "file"


def resolve(model_dir: Any) -> str:
    """Returns the canonical form of a model directory path.

    Local paths get ``~`` expanded and are made absolute against this
    process's working directory (call it on the chief: the PS tasks receive
    the absolute path inside the save ops, whatever their own cwd). A
    ``file://`` prefix is dropped. Remote paths are returned unchanged
    except for a trailing ``/``.

    Args:
        model_dir: A `str` or `os.PathLike`.

    Returns:
        The resolved path.

    Raises:
        ModelDirError: for None, an empty or blank string, a non-path object,
            or a path containing a NUL byte.
    """
    if model_dir is None:
        raise ModelDirError(model_dir, "is not set",
                            "pass a directory, e.g. --model_dir=/tmp/ctr or gs://bucket/ctr")
    try:
        path = os.fspath(model_dir)
    except TypeError:
        raise ModelDirError(model_dir, f"is a {type(model_dir).__name__}, not a path",
                            "pass a string such as '/tmp/ctr'") from None
    if isinstance(path, bytes):
        path = path.decode("utf-8", errors="replace")
    if not path.strip():
        raise ModelDirError(model_dir, "is empty",
                            "pass a directory, e.g. --model_dir=/tmp/ctr or gs://bucket/ctr")
    if "\0" in path:
        raise ModelDirError(model_dir, "contains a NUL byte", "pass a plain path")
    if path != path.strip():
        raise ModelDirError(model_dir, "has leading or trailing whitespace",
                            "remove the spaces (quote the path in the shell if needed)")
    if is_remote(path):
        scheme, rest = path.split("://", 1)
        if not rest.strip("/"):
            raise ModelDirError(model_dir, "names no bucket or directory",
                                f"pass e.g. {scheme}://bucket/dir")
        return path.rstrip("/")
    if path.lower().startswith("file://"):
        path = path[len("file://"):]
    return os.path.abspath(os.path.expanduser(path))


def ensure_writable(model_dir: str) -> str:
    """Creates `model_dir` if needed and checks that this process can write there.

    Writes and deletes one small probe file. Call it on the chief only.

    Args:
        model_dir: A path (resolved here).

    Returns:
        The resolved path.

    Raises:
        ModelDirError: if the directory cannot be created or written, or is a
            file, or its filesystem scheme is not available.
    """
    path = resolve(model_dir)
    remote = is_remote(path)
    fix_local = ("use a directory you can write to (check its permissions and that no "
                 "parent is a file), e.g. --model_dir=$HOME/runs/ctr")
    fix_remote = ("check the bucket name and credentials; for s3:// and other schemes TF 2.15 "
                  "does not ship, `pip install tensorflow-io` and `import tensorflow_io`")
    try:
        if tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path):
            raise ModelDirError(model_dir, "exists and is a file, not a directory",
                                "pass a directory path, or move the file away")
        tf.io.gfile.makedirs(path)
        probe = join(path, f".tf_psplugin_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("probe")
        tf.io.gfile.remove(probe)
    except ModelDirError:
        raise
    except (tf.errors.OpError, OSError) as e:
        reason = getattr(e, "message", None) or str(e)
        raise ModelDirError(model_dir, f"is not writable ({reason.splitlines()[0]})",
                            fix_remote if remote else fix_local) from None
    return path


def join(model_dir: str, *names: str) -> str:
    """Joins path components, with ``/`` for remote paths (`os.path.join` locally)."""
    if is_remote(model_dir):
        return "/".join([model_dir.rstrip("/")] + list(names))
    return os.path.join(model_dir, *names)


def write_json_atomic(path: str, data: Dict[str, Any]) -> None:
    """Writes JSON so that readers see either the old file or the whole new one.

    Locally: a temp file in the same directory, then a rename over `path`.
    Object stores (gs://, s3://) publish a whole object on close, which is
    already atomic, and their "rename" is a copy, so they are written directly.

    Args:
        path: Destination file.
        data: JSON-serialisable mapping.
    """
    text = json.dumps(data, sort_keys=True) + "\n"
    if is_remote(path):
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(text)
        return
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_json(path: str) -> Optional[Dict[str, Any]]:
    """Reads a JSON marker; None if it is missing, unreadable or not a JSON object."""
    try:
        with tf.io.gfile.GFile(path, "r") as f:
            data = json.loads(f.read())
    except tf.errors.NotFoundError:
        return None
    except (tf.errors.OpError, OSError, ValueError) as e:
        logging.warning("tf_psplugin: ignoring unreadable marker %s (%s)", path, e)
        return None
    return data if isinstance(data, dict) else None


def write_training_done(model_dir: str, step: int, checkpoint: Optional[str]) -> str:
    """Writes ``<model_dir>/TRAINING_DONE``: training is over, `step` is final.

    The evaluator exits once it has evaluated the checkpoint of that step.

    Returns:
        The marker's path.
    """
    path = join(model_dir, TRAINING_DONE)
    write_json_atomic(path, {"step": int(step), "checkpoint": checkpoint,
                             "wall_time": time.time()})
    return path


def read_training_done(model_dir: str) -> Optional[Dict[str, Any]]:
    """The ``TRAINING_DONE`` marker's content, or None while training runs."""
    data = read_json(join(model_dir, TRAINING_DONE))
    if data is None or not isinstance(data.get("step"), int):
        return None
    return data


def clear_training_done(model_dir: str) -> None:
    """Removes ``TRAINING_DONE`` (a resumed run is not done yet)."""
    path = join(model_dir, TRAINING_DONE)
    try:
        tf.io.gfile.remove(path)
    except tf.errors.NotFoundError:
        pass


def is_chief_task(environ=None) -> bool:
    """Whether this process may write into the model directory.

    True for the chief, and for a process with no ``TF_CONFIG`` at all
    (single-process training). Worker, PS and evaluator tasks are not chiefs;
    a first worker with no chief in the cluster is (it gets promoted, see
    `tf_psplugin.config`).

    Args:
        environ: where to read ``TF_CONFIG``; default `os.environ`.
    """
    environ = os.environ if environ is None else environ
    tf_config = environ.get("TF_CONFIG", "")
    if not tf_config.strip():
        return True
    try:
        return config_lib.from_tf_config(tf_config).is_chief
    except config_lib.ConfigError as e:
        data = {}
        try:
            data = json.loads(tf_config)
        except ValueError:
            pass
        task = data.get("task", {}) if isinstance(data, dict) else {}
        logging.warning("tf_psplugin: cannot parse TF_CONFIG (%s); treating task %r as %s",
                        e, task, "chief" if task.get("type") == "chief" else "non-chief")
        return isinstance(task, dict) and task.get("type") == "chief"


# --- Committed checkpoints: naming, commit markers, completeness ---------------


CHECKPOINT_NAME = "ckpt"
DELTA_NAME = "delta"
KIND_FULL = "full"
KIND_DELTA = "delta"
COMMIT_SUFFIX = ".commit"
_DATA_RE = re.compile(r"\.data-(\d{5})-of-(\d{5})$")
# Listings of a save's files before its commit: a shared FS may show them late.
_COMMIT_ATTEMPTS = 5


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as described by its commit marker.

    Attributes:
        path: The checkpoint prefix (pass it to `tf.train.Checkpoint.read`).
        step: Training step (optimizer iterations) at save time.
        input_position: Batches of the training dataset consumed by then (see
            `ChiefCheckpoint`), or None if unknown.
        wall_time: When the checkpoint was committed (seconds since epoch).
        files: Size in bytes of every file of the checkpoint, by name
            relative to the model directory.
        kind: ``"full"`` (a TF checkpoint) or ``"delta"`` (an incremental
            checkpoint: see `tf_psplugin.state.incremental`).
        base: For a delta, the base name (``ckpt-<m>``) of the full
            checkpoint its chain starts from.
        parent: For a delta, the base name of what it applies on top of: the
            base, or the previous delta (``delta-<k>``).
    """

    path: str
    step: int
    input_position: Optional[int] = None
    wall_time: float = 0.0
    files: Mapping[str, int] = dataclasses.field(default_factory=dict)
    kind: str = KIND_FULL
    base: Optional[str] = None
    parent: Optional[str] = None

    @property
    def name(self) -> str:
        """The base name: ``ckpt-<step>`` or ``delta-<step>``."""
        return os.path.basename(self.path)


# --- Finding complete checkpoints ---------------------------------------------


def _stat_size(path: str) -> Optional[int]:
    try:
        return int(tf.io.gfile.stat(path).length)
    except tf.errors.NotFoundError:
        return None


def _glob(pattern_dir: str, pattern: str) -> List[str]:
    """Files in `pattern_dir` matching `pattern` (the directory part is taken literally)."""
    if is_remote(pattern_dir):
        try:
            return tf.io.gfile.glob(join(pattern_dir, pattern))
        except tf.errors.NotFoundError:
            return []
    return glob_lib.glob(os.path.join(glob_lib.escape(pattern_dir), pattern))


def checkpoint_files(prefix: str) -> Dict[str, int]:
    """Sizes of the index and every data shard of `prefix`, by base name.

    Raises:
        CheckpointError: if the index or any data shard is missing.
    """
    files = {}
    index = prefix + ".index"
    size = _stat_size(index)
    if size is None:
        raise CheckpointError(f"checkpoint {prefix} has no index file ({index}).")
    files[os.path.basename(index)] = size
    shards = _glob(os.path.dirname(prefix), os.path.basename(prefix) + ".data-?????-of-?????")
    expected = None
    for shard in shards:
        expected = int(_DATA_RE.search(shard).group(2))
        files[os.path.basename(shard)] = _stat_size(shard) or 0
    if expected is None or len(shards) != expected:
        raise CheckpointError(
            f"checkpoint {prefix} is incomplete: {len(shards)} of {expected or '?'} data files.")
    return files


def verify_checkpoint(info: CheckpointInfo) -> Optional[str]:
    """Checks a committed checkpoint's files against its marker.

    Returns:
        None if every file exists with the recorded size, else the problem.
    """
    if not info.files:
        return "its commit marker lists no files"
    directory = os.path.dirname(info.path)
    for name, size in sorted(info.files.items()):
        actual = _stat_size(join(directory, name))
        if actual is None:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    return None


def _read_marker(marker: str) -> Optional[CheckpointInfo]:
    data = read_json(marker)
    prefix = marker[: -len(COMMIT_SUFFIX)]
    if data is None or not isinstance(data.get("step"), int) or not isinstance(
            data.get("files"), dict):
        return None
    kind = data.get("kind", KIND_FULL)
    if kind == KIND_DELTA and not (isinstance(data.get("base"), str)
                                   and isinstance(data.get("parent"), str)):
        return None
    position = data.get("input_position")
    return CheckpointInfo(path=prefix, step=data["step"],
                          input_position=position if isinstance(position, int) else None,
                          wall_time=float(data.get("wall_time", 0.0)),
                          files={str(k): int(v) for k, v in data["files"].items()},
                          kind=kind, base=data.get("base"), parent=data.get("parent"))


def list_checkpoints(model_dir: str) -> List[CheckpointInfo]:
    """Committed checkpoints in `model_dir`, oldest first (files not verified).

    Args:
        model_dir: The model directory (local or remote).
    """
    path = resolve(model_dir)
    markers = _glob(path, f"{CHECKPOINT_NAME}-*{COMMIT_SUFFIX}")
    infos = [info for info in map(_read_marker, markers)
             if info is not None and info.kind == KIND_FULL]
    return sorted(infos, key=lambda i: (i.step, i.wall_time))


def list_deltas(model_dir: str) -> List[CheckpointInfo]:
    """Committed deltas in `model_dir`, oldest first (files not verified)."""
    path = resolve(model_dir)
    markers = _glob(path, f"{DELTA_NAME}-*{COMMIT_SUFFIX}")
    infos = [info for info in map(_read_marker, markers)
             if info is not None and info.kind == KIND_DELTA]
    return sorted(infos, key=lambda i: (i.step, i.wall_time))


def checkpoint_chain(model_dir: str):
    """The latest intact full checkpoint and the deltas to apply on top of it, in order.

    The deltas are those whose base is that checkpoint, each the child of the
    previous one (the first one's parent is the base), all intact. The chain
    ends before the first delta that is torn (a file missing or of another
    size than its marker says, logged) or whose parent is not the delta before
    it (a delta that never committed); deltas after that are not applied,
    since each holds only the rows changed since its parent.

    Args:
        model_dir: The model directory.

    Returns:
        ``(full, deltas)``: a `CheckpointInfo` or None, and a list of them.
    """
    full = latest_checkpoint_info(model_dir)
    if full is None:
        return None, []
    chain: List[CheckpointInfo] = []
    parent = full.name
    for info in list_deltas(model_dir):
        if info.base != full.name or info.step <= full.step:
            continue
        if info.parent != parent:
            logging.warning("tf_psplugin: delta %s follows %s, not %s; the chain ends at %s",
                            info.path, info.parent, parent, parent)
            break
        problem = verify_checkpoint(info)
        if problem is not None:
            logging.warning("tf_psplugin: skipping delta %s and the deltas after it: %s",
                            info.path, problem)
            break
        chain.append(info)
        parent = info.name
    return full, chain


def delta_files(directory: str, model_dir: str) -> Dict[str, int]:
    """Sizes of every file under a delta's `directory`, by path relative to `model_dir`."""
    files = {}
    for root, _, names in tf.io.gfile.walk(directory):
        for name in names:
            full = join(root, name)
            rel = os.path.relpath(full, model_dir) if not is_remote(full) else \
                full[len(model_dir.rstrip("/")) + 1:]
            files[rel] = _stat_size(full) or 0
    return files


def _complete_delta_files(prefix: str, bundles: Sequence[str]) -> Dict[str, int]:
    """`delta_files` once every bundle in `bundles` is complete (index and all data files).

    Raises:
        CheckpointError: a bundle is incomplete, or the directory holds no file.
    """
    for bundle in bundles:
        checkpoint_files(bundle)
    files = delta_files(prefix, os.path.dirname(prefix))
    if not files:
        raise CheckpointError(f"delta {prefix} has no files.")
    return files


def commit_delta(prefix: str, step: int, input_position: Optional[int], base: str,
                 parent: str, manifest: Mapping[str, Any],
                 bundles: Sequence[str] = ()) -> CheckpointInfo:
    """Writes the commit marker of a delta whose files are all written.

    As for a full checkpoint (`commit_checkpoint`), the files are listed
    only once every bundle the delta wrote is complete, retried for a
    while: a shared filesystem may show the PS tasks' files late, and a
    marker that missed one would name a delta no reader can apply.

    Args:
        prefix: ``<model_dir>/delta-<step>`` (the delta's directory).
        step: Training step the delta brings the chain to.
        input_position: Batches consumed by then, or None.
        base: Base name of the chain's full checkpoint (``ckpt-<m>``).
        parent: Base name of the checkpoint or delta this one applies on.
        manifest: What the delta holds (tables, slots, dense keys), for readers.
        bundles: Prefixes of the tensor bundles written (each must have its
            index and every data file).

    Returns:
        The committed delta's `CheckpointInfo`.

    Raises:
        CheckpointError: a bundle is still incomplete after the retries.
    """
    files = None
    for attempt in range(_COMMIT_ATTEMPTS):  # A shared FS may show the PS tasks' files late.
        try:
            files = _complete_delta_files(prefix, bundles)
            break
        except CheckpointError as e:
            if attempt == _COMMIT_ATTEMPTS - 1:
                raise CheckpointError(
                    f"{e} TF reported the delta as written, but the chief cannot see the "
                    "files the PS tasks wrote. Fix: model_dir must be one filesystem shared "
                    "by the chief and every PS task under the same absolute path, or use "
                    "write_on_chief=True.") from None
            time.sleep(0.2 * (attempt + 1))
    info = CheckpointInfo(path=prefix, step=int(step), input_position=input_position,
                          wall_time=time.time(), files=files, kind=KIND_DELTA, base=base,
                          parent=parent)
    write_json_atomic(prefix + COMMIT_SUFFIX, {
        "kind": KIND_DELTA, "step": info.step, "input_position": input_position,
        "wall_time": info.wall_time, "files": dict(files), "checkpoint": info.name,
        "base": base, "parent": parent, "manifest": dict(manifest)})
    return info


def drop_orphan_deltas(model_dir: str, kept_full_names) -> List[str]:
    """Deletes the deltas whose base full checkpoint is not among `kept_full_names`.

    A delta holds only rows changed since its parent, so it is useless
    without its base; and a base is never deleted for a delta's sake here
    (TF's manager decides which full checkpoints to keep: `max_to_keep`
    counts chains).

    Returns:
        The paths of the deltas deleted.
    """
    kept = set(kept_full_names)
    dropped = []
    for delta in list_deltas(model_dir):
        if delta.base not in kept:
            remove_delta(delta.path)
            dropped.append(delta.path)
    return dropped


def remove_delta(prefix: str) -> None:
    """Deletes a delta: its marker first (never a marker without files), then its files."""
    remove_commit_marker(prefix)
    if tf.io.gfile.exists(prefix):
        tf.io.gfile.rmtree(prefix)


def latest_checkpoint_info(model_dir: str) -> Optional[CheckpointInfo]:
    """The newest committed checkpoint whose files are all intact, or None.

    Torn checkpoints (files missing or truncated after the marker was
    written, e.g. by a crash while an old checkpoint was being deleted) are
    skipped with a warning. Checkpoints without a marker (a save that crashed
    before committing) are never considered.

    Args:
        model_dir: The model directory.
    """
    for info in reversed(list_checkpoints(model_dir)):
        problem = verify_checkpoint(info)
        if problem is None:
            return info
        logging.warning("tf_psplugin: skipping checkpoint %s: %s", info.path, problem)
    return None


def commit_checkpoint(prefix: str, step: int, input_position: Optional[int]) -> CheckpointInfo:
    """Writes the commit marker of a checkpoint TF has finished writing."""
    files = None
    for attempt in range(_COMMIT_ATTEMPTS):  # A shared FS may show the PS tasks' files late.
        try:
            files = checkpoint_files(prefix)
            break
        except CheckpointError as e:
            if attempt == _COMMIT_ATTEMPTS - 1:
                raise CheckpointError(
                    f"{e} TF reported the save as done, but the chief cannot see the files the "
                    "PS tasks wrote. Fix: model_dir must be one filesystem shared by the chief "
                    "and every PS task under the same absolute path (NFS, GCS, HDFS...), or "
                    "use write_on_chief=True for tables small enough to pass through the "
                    "chief.") from None
            time.sleep(0.2 * (attempt + 1))
    info = CheckpointInfo(path=prefix, step=int(step), input_position=input_position,
                          wall_time=time.time(), files=files)
    write_json_atomic(prefix + COMMIT_SUFFIX, {
        "kind": KIND_FULL, "step": info.step, "input_position": input_position,
        "wall_time": info.wall_time, "files": dict(files), "checkpoint": os.path.basename(prefix)})
    return info


def remove_commit_marker(prefix: str) -> None:
    try:
        tf.io.gfile.remove(prefix + COMMIT_SUFFIX)
    except tf.errors.NotFoundError:
        pass


def info_for_prefix(prefix: str) -> CheckpointInfo:
    """A CheckpointInfo for an explicit prefix (its marker if any, else the files)."""
    info = _read_marker(prefix + COMMIT_SUFFIX)
    if info is not None:
        problem = verify_checkpoint(info)
        if problem is not None:
            raise CheckpointError(f"checkpoint {prefix} is damaged: {problem}.")
        return info
    files = checkpoint_files(prefix)  # Raises for missing files.
    match = re.search(r"-(\d+)$", prefix)
    return CheckpointInfo(path=prefix, step=int(match.group(1)) if match else 0, files=files)


def resolve_checkpoint(source: str) -> CheckpointInfo:
    """A model directory (its latest committed checkpoint) or a checkpoint prefix.

    Raises:
        CheckpointError: if `source` holds no usable checkpoint.
    """
    path = resolve(source)
    if tf.io.gfile.isdir(path):
        info = latest_checkpoint_info(path)
        if info is None:
            raise CheckpointError(
                f"no committed checkpoint in {path} (no intact ckpt-*.commit). Fix: pass the "
                "model_dir the chief trained into, or a checkpoint prefix such as "
                f"{join(path, 'ckpt-100')}.")
        return info
    return info_for_prefix(path)
