"""The composition suite: stacking on/off x optimizer x mode x situation (issue 40 item 3).

Table stacking is the default (``stack_tables=True``). Every cell is one
small Keras job (tests/cluster/scripts/composition.py says what each
optimizer, mode and situation adds), run once stacked and once with
``stack_tables=False``; the cell holds when

* both runs end with the same weights, and the same final checkpoint
  tensors (tables, optimizer slots, dense), within 1e-5; or both are
  refused, before the first step, with the same error naming the fix, and
  the refusal is one of `REFUSED` (by design);
* its mode's own check holds in both runs: ``kill`` (a chief killed after
  its step-4 checkpoint, restarted from it) ends bit for bit (max abs diff
  0.0) like the uninterrupted run of the same stacking, weights and final
  checkpoint; ``full_every``: the incremental chain restores bit for bit
  into a new model; ``export``: the `ServingModel` scores equal the live
  weights' scores (1e-5).

The full product (5 optimizers x 4 modes x 5 situations = 100 cells, each
stacked and unstacked) does not fit CI's time. CI runs `PAIRWISE` (25 cells:
every pair of values of two of the three factors in at least one cell, and
every cell on and off), plus the cell outside the matrix in `EXTRA` (a
subclassed model and a second one in scope, with Keras's Adam): two chief
processes per stacking (``run``, then ``resume`` for the killed jobs); each
cell is one test, which reads the results of that one run. A fourth factor, the precision (`PRECISIONS`: float32, the cells
above; tables in bfloat16 under ``mixed_bfloat16``; tables in float16
under ``mixed_float16``), adds `HALF_DESIGN`: six cells per half
precision, so that each of its values meets every optimizer, mode and
situation (and stacking on and off) in some cell, each mode and situation
in a cell that trains (a legacy optimizer is refused with half-precision
tables, by design), and in the bfloat16 group three cells of bfloat16
tables under the float32 policy and under ``mixed_float16``; one group
per precision. The ``full_product`` tests run the whole product, one group per
optimizer. Every group runs on the same cluster (1 worker, 2 PS) of the
cluster tests' pool (`Runs`). docs/composition.md shows the matrix and what each family of
cells checks.
"""

import itertools
import json
import os

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "composition.py")
OPTIMIZERS = ("adagrad", "adam", "sgd", "ftrl", "legacy_adagrad")
MODES = ("fit", "kill", "full_every", "export")
SITUATIONS = ("frozen", "second_model", "subclassed", "ema", "early_stop")

pytestmark = [pytest.mark.cluster]


def refusal(cell):
    """The error text a cell is refused with by design (stacked or not), else None."""
    optimizer, mode, situation = factors(cell)
    if optimizer == "legacy_adagrad" and precision(cell) != "float32":
        # A legacy optimizer's fused kernel takes the table's handle, whose dtype
        # must be its float32 slots' (tables/half_precision.py); under
        # mixed_float16 the strategy refuses it for the loss scaling first.
        return {"bfloat16": "Fix: use an optimizer of tf.keras.optimizers (not .legacy), "
                            "or table_dtype=None",
                "float16": "mixed_float16 with a legacy optimizer"}[precision(cell)]
    if situation == "ema" and precision(cell) != "float32":
        # Keras averages the table's half-precision rows with a float32 average.
        return "with use_ema=True (its moving average 'average/"
    if optimizer == "legacy_adagrad" and situation == "ema":
        # Keras's legacy optimizers have no use_ema: Keras itself refuses the argument.
        return "use_ema"
    if mode != "full_every":
        return None
    if situation == "ema":
        return "(use_ema=True) writes every row of every table each step. Fix: drop use_ema"
    return {
        "adam": "Keras's Adam (tf.keras.optimizers.Adam) decays every table row's moments "
                "each step, so every delta would hold whole tables. Fix: tf_psplugin.LazyAdam",
        "sgd": "Keras's SGD (tf.keras.optimizers.SGD) assigns every table row and its "
               "momentum slot each step, even with momentum=0. Fix: "
               "tf.keras.optimizers.legacy.SGD",
        "ftrl": "Keras's Ftrl (tf.keras.optimizers.Ftrl) computes its update densely and "
                "assigns every table row each step. Fix: tf.keras.optimizers.legacy.Ftrl",
    }.get(optimizer)


# The pairwise design, one row per optimizer and one column per situation
# (25 cells, every (optimizer, situation) pair once). The modes are placed by
# hand so that every (optimizer, mode) and (mode, situation) pair is in some
# cell too (checked below), and so that `full_every` runs for real with a
# row-local optimizer in every situation but ``ema`` (refused with any
# optimizer), rather than being refused.
DESIGN = {
    #                 frozen        second_model  subclassed    ema           early_stop
    "adagrad":        ("full_every", "full_every", "fit",        "kill",       "export"),
    "adam":           ("export",     "kill",       "kill",       "full_every", "fit"),
    "sgd":            ("full_every", "fit",        "export",     "export",     "kill"),
    "ftrl":           ("fit",        "kill",       "full_every", "export",     "fit"),
    "legacy_adagrad": ("kill",       "export",     "full_every", "fit",        "full_every"),
}


def pairwise_design():
    """The cells of `DESIGN`, as ``<optimizer>.<mode>.<situation>``."""
    return [f"{optimizer}.{mode}.{situation}" for optimizer, modes in DESIGN.items()
            for mode, situation in zip(modes, SITUATIONS)]


def factors(cell):
    """(optimizer, mode, situation) of `cell`, without its policy suffix."""
    optimizer, mode, situation = cell.split("+")[0].split(".")
    return optimizer, mode, situation


def precision(cell):
    """The cell's value of `PRECISIONS`: the table dtype of its `HALF_DESIGN` group, else float32."""
    return next((p for p, cells in HALF.items() if cell in cells), "float32")


def uncovered_pairs(cells, trained_only=False):
    """The value pairs of two factors no cell of `cells` has.

    `trained_only`: counts only the cells not refused by design (`refusal`).
    """
    rows = [factors(cell) + (precision(cell),) for cell in cells
            if not (trained_only and refusal(cell))]
    missing = []
    for (a, va), (b, vb) in itertools.combinations(
            enumerate((OPTIMIZERS, MODES, SITUATIONS, PRECISIONS)), 2):
        seen = {(row[a], row[b]) for row in rows}
        missing += [(x, y) for x in va for y in vb if (x, y) not in seen]
    return missing


# The precision factor: float32 (the cells of `DESIGN`), or the tables stored
# in a half precision (the strategy's `table_dtype`, one chief process per
# value), the cell's models under the Keras policy of that precision
# (``+<policy>``; a policy is per cell, a table dtype per process).
PRECISIONS = ("float32", "bfloat16", "float16")
POLICIES = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
# Per half precision: every optimizer and every situation once, every mode,
# and the legacy optimizer's cell again with a new one, so that each mode,
# situation but ``ema`` and optimizer but the legacy one meets the precision
# in a cell that trains (``ema`` and the legacy optimizer are refused with
# half-precision tables before the first step, with the fix). Besides, in
# the bfloat16 group: bfloat16 tables under the float32 policy and under
# ``mixed_float16`` (its own suffix), killed and resumed, and with
# ``full_every``. float16 on a CPU is slow (no float16 arithmetic), but these
# jobs are tiny.
HALF_DESIGN = {
    "bfloat16": ("adagrad.full_every.second_model", "adam.kill.frozen", "sgd.export.ema",
                 "ftrl.fit.early_stop", "legacy_adagrad.fit.subclassed",
                 "sgd.export.subclassed", "adagrad.kill.frozen+",
                 "adam.kill.subclassed+mixed_float16", "adagrad.full_every.frozen+mixed_float16"),
    "float16": ("adagrad.kill.ema", "adam.export.second_model", "sgd.fit.frozen",
                "ftrl.kill.subclassed", "legacy_adagrad.export.early_stop",
                "adagrad.full_every.early_stop"),
}


def half_design():
    """{precision: its cells, as ``<optimizer>.<mode>.<situation>[+<policy>]``}.

    A cell of `HALF_DESIGN` without a suffix takes its precision's policy;
    ``+`` alone: the float32 policy.
    """
    def name(cell, policy):
        if "+" not in cell:
            return f"{cell}+{policy}"
        return cell.rstrip("+")
    return {p: [name(cell, POLICIES[p]) for cell in cells] for p, cells in HALF_DESIGN.items()}


PAIRWISE = pairwise_design()
HALF = half_design()
assert len(set(PAIRWISE + sum(HALF.values(), []))) == len(PAIRWISE) + sum(map(len, HALF.values()))
assert not uncovered_pairs(PAIRWISE + sum(HALF.values(), [])), uncovered_pairs(
    PAIRWISE + sum(HALF.values(), []))
# A half precision meets every mode, every situation but ema and every optimizer
# but the legacy one (both refused) in a cell that trains.
assert not [pair for pair in uncovered_pairs(PAIRWISE + sum(HALF.values(), []), trained_only=True)
            if pair[1] in POLICIES and pair[0] not in ("legacy_adagrad", "ema")]
FULL = [".".join(c) for c in itertools.product(OPTIMIZERS, MODES, SITUATIONS)]


def run_cells(cluster, root, cells, timeout, table_dtype=None):
    """Runs `cells` stacked and unstacked on `cluster`; returns {stacking: {cell: result}}.

    `table_dtype` (e.g. ``"bfloat16"``): the strategy stores the tables so
    (``HybridOptions.table_dtype``, tests/cluster/test_half_tables.py).
    """
    cluster.start_servers()
    kills = any(".kill." in cell for cell in cells)
    suffix = f"+{table_dtype}" if table_dtype else ""
    for stacking in ("stacked", "unstacked"):
        for phase in ("run", "resume") if kills else ("run",):
            result = cluster.run_chief(
                [cu.PYTHON, SCRIPT, stacking + suffix, str(root), phase] + list(cells),
                timeout=timeout)
            # A run with kill cells ends killed (-9) by its last kill cell.
            expected = -9 if (phase == "run" and kills) else 0
            assert result.returncode == expected, (stacking, phase, result.stdout[-8000:])
    return {stacking: {cell: load(root / (stacking + suffix) / cell) for cell in cells}
            for stacking in ("stacked", "unstacked")}


class Runs:
    """Cell results run on demand, one group of cells at a time, on the package's clusters.

    Every group runs on the same started cluster (1 worker, 2 PS) of the
    `_cluster_pool` fixture: a group's chief processes (one per stacking and
    phase) connect to it one after another, as a group's own did before; a
    cluster whose group failed is discarded, so the next group starts a
    fresh one.
    """

    SHAPE = (1, 2)

    def __init__(self, root, pool):
        self.root, self.pool, self.results = root, pool, {}

    def get(self, group, cells, timeout, table_dtype=None):
        if group not in self.results:
            try:
                with self.pool.borrowed(*self.SHAPE) as cluster:
                    self.results[group] = run_cells(cluster, self.root / group, cells, timeout,
                                                    table_dtype=table_dtype)
            except AssertionError as e:
                self.results[group] = e
        if isinstance(self.results[group], AssertionError):
            raise self.results[group]
        return self.results[group]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _cluster_pool):
    return Runs(tmp_path_factory.mktemp("composition"), _cluster_pool)


def load(out):
    with open(out / "result.json", encoding="utf-8") as f:
        result = json.load(f)
    for name in ("weights", "ref", "resumed"):
        if (out / f"{name}.npz").exists():
            result[name] = dict(np.load(str(out / f"{name}.npz")))
    return result


def split_slots(cell, weights):
    """(`weights` without, and with only, the new optimizers' by-position slot list).

    Keras's new optimizers checkpoint their variables as one list by position
    (``optimizer/_variables/<i>``), compared on their own by
    `test_new_optimizer_checkpoint_slots_match_unstacked`.
    """
    if cell.startswith("legacy_"):
        return weights, {}
    listed = {k: v for k, v in weights.items() if k.startswith(SLOT_LIST)}
    return {k: v for k, v in weights.items() if k not in listed}, listed


SLOT_LIST = "ckpt/optimizer/_variables/"


def max_diff(a, b):
    """Max abs difference of two weight dicts with the same keys (inf if keys differ)."""
    if sorted(a) != sorted(b):
        return float("inf"), sorted(set(a) ^ set(b))
    return max(entry_diff(a[k], b[k]) for k in a), None


def entry_diff(a, b):
    """Max abs difference of two arrays; 0 or inf for the checkpoint's strings."""
    if a.dtype.kind in "SUO":
        return 0.0 if np.array_equal(a, b) else float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0


def cell_problems(cell, stacked, unstacked):
    """What is wrong with `cell` (a list of strings; empty when it holds)."""
    problems = []
    expected = refusal(cell)
    runs = {"stacked": stacked, "unstacked": unstacked}
    if expected is not None:
        for name, run in runs.items():
            if run["status"] != "refused" or expected not in run.get("error", ""):
                problems.append(f"{name}: expected refusal {expected!r}, got {run}")
            elif run["step"] != 0:
                problems.append(f"{name}: refused at step {run['step']}, not before step 1")
        return problems
    for name, run in runs.items():
        if run["status"] != "ok":
            problems.append(f"{name}: {run.get('error', run['status'])}")
    if problems:
        return problems
    _, mode, situation = factors(cell)
    if mode == "kill":
        for name, run in runs.items():
            if run["resumed_from"] != 4:
                problems.append(f"{name}: resumed from step {run['resumed_from']}, not 4")
            # Keras's EarlyStopping keeps its best weights in memory only: a
            # restarted fit starts it afresh, stacked or not (docs/composition.md).
            if situation != "early_stop":
                diff, keys = max_diff(run["resumed"], run["ref"])
                if diff != 0.0:
                    problems.append(f"{name}: resumed vs uninterrupted differ by {diff} {keys}")
        key = "resumed"
    else:
        key = "weights"
    (ours, _), (theirs, _) = split_slots(cell, stacked[key]), split_slots(cell, unstacked[key])
    diff, keys = max_diff(ours, theirs)
    if not diff <= 1e-5:
        worst = keys or sorted(ours, key=lambda k: -entry_diff(ours[k], theirs[k]))[:3]
        problems.append(f"stacked vs unstacked differ by {diff}: {worst}")
    for name, run in runs.items():
        for check in ("restore_diff", "serving_diff"):
            limit = 0.0 if check == "restore_diff" else 1e-5
            if check in run and not run[check] <= limit:
                problems.append(f"{name}: {check} = {run[check]}")
    return problems


def assert_cells_hold(results, cells):
    problems = {cell: cell_problems(cell, results["stacked"][cell], results["unstacked"][cell])
                for cell in cells}
    problems = {cell: p for cell, p in problems.items() if p}
    assert not problems, json.dumps(problems, indent=1)[:12000]


# Outside the matrix: a subclassed model's stacks are split from a second
# model's at its first traced call, as a functional model's are (else Keras's
# Adam would refuse the apply of a stack shared with tables it does not train).
EXTRA = ["adam.fit.subclassed_second"]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("cell", PAIRWISE + EXTRA)
def test_pairwise_cell_ends_like_unstacked(runs, cell):
    results = runs.get("pairwise", PAIRWISE + EXTRA, timeout=900)
    assert_cells_hold(results, [cell])


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("cell", [c for p in PRECISIONS[1:] for c in HALF[p]])
def test_half_precision_cell_ends_like_unstacked(runs, cell):
    """A cell with half-precision tables under the policy of that precision.

    The same checks as the float32 cells; besides, every table of the cell
    is stored in that dtype (stacked: the trainable ones share a stack), and
    a refusal came before the first step (`refusal`, asserted by
    `cell_problems`).
    """
    table_dtype = precision(cell)
    results = runs.get(f"pairwise_{table_dtype}", HALF[table_dtype], timeout=900,
                       table_dtype=table_dtype)
    assert_cells_hold(results, [cell])
    for stacking in ("stacked", "unstacked"):
        tables = results[stacking][cell]["tables"]
        assert tables and {t["dtype"] for t in tables} == {table_dtype}, (stacking, tables)
        stacks = [t["stack"] for t in tables if t["stack"]]
        if stacking == "unstacked":
            assert not stacks, tables
        elif refusal(cell) is None and factors(cell)[1] != "full_every":
            # (full_every: each table in a stack of its own, as in float32.)
            assert max(stacks.count(x) for x in stacks) >= 2, tables
        if cell.endswith("+mixed_float16") and refusal(cell) is None:
            # Trained under Keras's loss scaling, saved with the model.
            saved = results[stacking][cell]["resumed" if ".kill." in cell else "weights"]
            assert any("loss_scale" in k for k in saved), sorted(saved)[:20]


@pytest.mark.timeout(1500)
def test_new_optimizer_checkpoint_slots_match_unstacked(runs):
    """Keras's new optimizers' by-position slot list holds per-table slots when stacked too.

    Each stacked table's slots are listed where an unstacked table's shard
    slots are (tables/stacked_slots.py): same keys, shapes and values.
    """
    results = runs.get("pairwise", PAIRWISE + EXTRA, timeout=900)
    differ = {}
    for cell in PAIRWISE:
        stacked, unstacked = results["stacked"][cell], results["unstacked"][cell]
        key = "resumed" if ".kill." in cell else "weights"
        if key in stacked and key in unstacked and not cell.startswith("legacy_"):
            diff, keys = max_diff(split_slots(cell, stacked[key])[1],
                                  split_slots(cell, unstacked[key])[1])
            if not diff <= 1e-5:
                differ[cell] = (diff, keys)
    assert not differ, differ


# The full product: 100 cells, about 8 minutes per optimizer group on 2 cores,
# so about 40 minutes per TF version: beyond CI's budget, hence its own marker,
# deselected by `make test` and run by `make test-composition-full`.
@pytest.mark.full_product
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("cell", FULL)
def test_full_product_cell_ends_like_unstacked(runs, cell):
    optimizer = cell.split(".")[0]
    group = [c for c in FULL if c.startswith(optimizer + ".")]
    assert_cells_hold(runs.get("full_" + optimizer, group, timeout=1200), [cell])
