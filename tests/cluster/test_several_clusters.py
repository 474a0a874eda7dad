"""One process builds a strategy against several clusters in turn (issue 18, item 4)."""

import json
import os

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

pytestmark = pytest.mark.cluster

SCRIPT = os.path.join(cu.REPO_ROOT, "tests", "cluster", "scripts", "several_clusters.py")


@pytest.mark.timeout(400)
def test_three_clusters_one_after_another_in_one_process(procs):
    result = procs.run([cu.PYTHON, SCRIPT, "3"], timeout=360)
    # A crash inside TF (the reported segfault) is a negative return code.
    assert result.returncode == 0, result.stdout[-6000:]
    lines = [json.loads(ln) for ln in result.stdout.splitlines() if ln.startswith("{")]
    assert [ln["cluster"] for ln in lines] == [0, 1, 2], result.stdout[-6000:]
    assert all(np.isfinite(ln["loss"]) for ln in lines), lines
    # Three different clusters (fresh ports), each with its table on both PS tasks.
    assert len({tuple(ln["ports"]) for ln in lines}) == 3, lines
    for ln in lines:
        assert ln["table_devices"] == [f"/job:ps/replica:0/task:{p}/device:CPU:0"
                                       for p in (0, 1)], ln
    assert "\ndone\n" in result.stdout, result.stdout[-6000:]
    assert not cu.tagged_pids(procs.tag)
