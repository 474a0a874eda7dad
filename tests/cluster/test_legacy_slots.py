"""A Keras legacy optimizer shows a stacked table's slots as the unstacked table's (issue 40).

On a shared 1-worker / 2-PS cluster (tables stack over 2 or more PS), a
two-table model is trained with `fit` by each legacy optimizer (Adagrad,
Adam, SGD with momentum, Ftrl), with `stack_tables` on and off
(scripts/legacy_slots.py). Everything the optimizer shows must be the
same: `variables()` and `weights` (names, shapes, order exactly; values
within 1e-6), `get_slot_names()`, `get_slot(var, name)` of every variable
the model lists, `get_weights()`, the checkpoint's keys and shapes (and its
values), and after `set_weights` and one more step, the optimizer's and
the model's weights.
"""

import json
import os

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "legacy_slots.py")
OPTIMIZERS = ("adagrad", "adam", "sgd_momentum", "ftrl")

pytestmark = [pytest.mark.cluster]


def _run(shared_cluster, out, stacking):
    out.mkdir(parents=True)
    result = shared_cluster(num_workers=1, num_ps=2).run_chief(
        [cu.PYTHON, SCRIPT, stacking, str(out)], timeout=420)
    assert result.returncode == 0 and "DONE" in result.stdout, (stacking, result.stdout[-6000:])
    found = {}
    for name in OPTIMIZERS:
        with open(out / f"{name}.json", encoding="utf-8") as f:
            found[name] = (json.load(f), dict(np.load(str(out / f"{name}.npz"))))
    return found


@pytest.mark.timeout(1200)
def test_legacy_optimizers_show_stacked_tables_slots_as_unstacked(shared_cluster, tmp_path):
    stacked = _run(shared_cluster, tmp_path / "stacked", "stacked")
    unstacked = _run(shared_cluster, tmp_path / "unstacked", "unstacked")
    for name in OPTIMIZERS:
        (got, got_values), (want, want_values) = stacked[name], unstacked[name]
        # Names, shapes and order: exactly (the model's variables too).
        for what in ("model_variables", "variables", "weights", "slot_names", "get_slot",
                     "checkpoint"):
            assert got[what] == want[what], (name, what)
        assert not any("stacked_tables" in n for _, n, _ in got["variables"]), name
        # Each table's slots are listed (2 tables x 2 shards per slot name).
        table_slots = [n for _, n, _ in want["variables"] if "embeddings/part_" in n]
        assert len(table_slots) == 4 * len(want["slot_names"]), (name, want["variables"])
        assert sorted(got_values) == sorted(want_values), name
        for key, value in want_values.items():
            if value.dtype.kind in "SUO":  # A checkpoint's string (a format marker).
                assert np.array_equal(got_values[key], value), (name, key)
                continue
            np.testing.assert_allclose(got_values[key], value, rtol=0, atol=1e-6,
                                       err_msg=f"{name} {key}")
        for key in [k for k in got_values if k.startswith("set_weights/")]:
            # set_weights wrote through to what get_weights reads.
            np.testing.assert_array_equal(
                got_values[key], got_values["set_weights_given/" + key.split("/", 1)[1]])
