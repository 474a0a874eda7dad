"""benchmarks/incremental_dynamic.py: arguments, and its chief script compiles."""

import pytest

from benchmarks import incremental_dynamic


def test_arguments():
    args = incremental_dynamic.parse_args([])
    assert (args.capacity, args.dim, args.fraction_list) == (1_000_000, 16, [0.01, 0.1])
    for bad in (["--fractions", "0"], ["--fractions", "0.9"], ["--capacity", "10"]):
        with pytest.raises(SystemExit):
            incremental_dynamic.parse_args(bad)


def test_chief_script_compiles():
    compile(incremental_dynamic.CHIEF, "incremental_dynamic_chief.py", "exec")
