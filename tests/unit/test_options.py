"""`HybridOptions` and how the strategy's constructor takes its knobs.

The knobs keep working as keywords of `HybridParameterServerStrategy`;
`options=` is the same set in one value; a knob given both ways with
different values is an error naming both. The constructor cases stop at the
connection (closed ports, short timeout), as in test_stock_constructor.py.
"""

import dataclasses
import time

import pytest
import tf_psplugin
from tests.unit._stub_cluster import chief_worker_ps_resolver
from tf_psplugin.runtime import options as options_lib


_resolver = chief_worker_ps_resolver


@pytest.mark.parametrize("knob,value,error", [
    ("embedding_updates", "eventually", tf_psplugin.StrategyError),
    ("dense_placement", "gpu", tf_psplugin.StrategyError),
    ("sparse_exchange", "gossip", tf_psplugin.StrategyError),
    ("collective_timeout_seconds", -1.0, tf_psplugin.StrategyError),
    ("collective_timeout_seconds", float("nan"), tf_psplugin.StrategyError),
    ("sharding", "random", ValueError),  # PlacementPolicy's own error
])
def test_an_unsupported_knob_is_refused_when_the_options_are_made(knob, value, error):
    with pytest.raises(error, match=rf"{knob}.*Fix:"):
        tf_psplugin.HybridOptions(**{knob: value})
    with pytest.raises(error, match=rf"{knob}.*Fix:"):
        tf_psplugin.HybridOptions().replace(**{knob: value})


def test_options_are_frozen_and_replace_makes_a_changed_copy():
    options = tf_psplugin.HybridOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.stack_tables = False
    changed = options.replace(stack_tables=False, sparse_exchange="allgather")
    assert not changed.stack_tables and changed.sparse_exchange == "allgather"
    assert options.stack_tables and options.sparse_exchange == "ps"


def test_tables_are_stacked_by_default_and_stack_tables_false_is_the_way_out():
    assert tf_psplugin.HybridOptions().stack_tables
    assert not options_lib.resolve(None, {"stack_tables": False}).stack_tables


def test_knobs_alone_change_the_defaults():
    got = options_lib.resolve(None, {"fuse_lookups": True, "collective_timeout_seconds": 5})
    assert got == tf_psplugin.HybridOptions(fuse_lookups=True, collective_timeout_seconds=5)
    assert options_lib.resolve(None, {}) == tf_psplugin.HybridOptions()


def test_a_knob_given_twice_with_the_same_value_is_accepted():
    options = tf_psplugin.HybridOptions(stack_tables=False)
    assert options_lib.resolve(options, {"stack_tables": False}) is options


def test_a_knob_given_twice_with_different_values_names_both():
    options = tf_psplugin.HybridOptions(stack_tables=False)
    with pytest.raises(tf_psplugin.StrategyError,
                       match=r"options=HybridOptions\(stack_tables=False\), stack_tables=True\)"
                             r".*given twice.*Fix:"):
        options_lib.resolve(options, {"stack_tables": True})


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stak_tables'"):
        options_lib.resolve(None, {"stak_tables": True})


def test_options_of_another_type_are_refused():
    with pytest.raises(tf_psplugin.StrategyError, match=r"must be a tf_psplugin.HybridOptions"):
        options_lib.resolve({"stack_tables": True}, {})


def test_the_strategy_takes_its_knobs_from_options():
    """connect_timeout_seconds=0.5 in options: 'cannot reach' after 0.5 s, not 300 s."""
    start = time.monotonic()
    with pytest.raises(tf_psplugin.StrategyError, match="cannot reach"):
        tf_psplugin.HybridParameterServerStrategy(
            _resolver(), options=tf_psplugin.HybridOptions(connect_timeout_seconds=0.5))
    assert time.monotonic() - start < 60.0


def test_the_strategy_refuses_conflicting_knobs_before_connecting():
    start = time.monotonic()
    with pytest.raises(tf_psplugin.StrategyError, match=r"connect_timeout_seconds is given twice"):
        tf_psplugin.HybridParameterServerStrategy(
            _resolver(), options=tf_psplugin.HybridOptions(connect_timeout_seconds=0.5),
            connect_timeout_seconds=300.0)
    assert time.monotonic() - start < 5.0


def test_the_strategy_refuses_an_unknown_keyword():
    with pytest.raises(TypeError, match=r"HybridParameterServerStrategy\(\) got an unexpected "
                                        r"keyword argument 'stak_tables'"):
        tf_psplugin.HybridParameterServerStrategy(_resolver(), stak_tables=True)


def test_every_knob_is_a_documented_field():
    doc = tf_psplugin.HybridOptions.__doc__
    for knob in options_lib.KNOBS:
        assert f"        {knob}:" in doc, knob
