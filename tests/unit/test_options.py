"""`HybridOptions` and how the strategy's constructor takes its knobs.

`options=` is how knobs are given; as keywords of
`HybridParameterServerStrategy` they keep working with a
`DeprecationWarning` naming the field; a knob given both ways with
different values is an error naming both. The developer toggles' former
names and ``HybridOptions(sharding=)`` are deprecated aliases; refused
combinations name the fields and the fix. The constructor cases stop at the
connection (closed ports, short timeout), as in test_stock_constructor.py.
"""

import contextlib
import dataclasses
import inspect
import time
import warnings

import pytest
import tf_psplugin
from tests.unit._stub_cluster import chief_worker_ps_resolver
from tf_psplugin.runtime import options as options_lib


_resolver = chief_worker_ps_resolver


@pytest.mark.parametrize("knob,value,error", [
    ("embedding_updates", "eventually", tf_psplugin.StrategyError),
    ("dense_placement", "gpu", tf_psplugin.StrategyError),
    ("experimental_sparse_exchange", "gossip", tf_psplugin.StrategyError),
    ("collective_timeout_seconds", -1.0, tf_psplugin.StrategyError),
    ("collective_timeout_seconds", float("nan"), tf_psplugin.StrategyError),
    ("sharding", "random", ValueError),  # PlacementPolicy's own error
    ("dense_bucket_bytes", -1, tf_psplugin.StrategyError),
    ("dense_bucket_bytes", 1.5, tf_psplugin.StrategyError),
    ("dense_bucket_bytes", True, tf_psplugin.StrategyError),
    ("dense_allreduce_dtype", "int8", tf_psplugin.StrategyError),
    ("dense_allreduce_dtype", "float32", tf_psplugin.StrategyError),
    ("dense_allreduce_dtype", "bf16", tf_psplugin.StrategyError),
])
def test_an_unsupported_knob_is_refused_when_the_options_are_made(knob, value, error):
    # HybridOptions(sharding=) is deprecated (PlacementPolicy's): it warns, then refuses.
    def deprecated():
        return (pytest.warns(DeprecationWarning, match="sharding has one home")
                if knob == "sharding" else contextlib.nullcontext())

    with pytest.raises(error, match=rf"{knob}.*Fix:"), deprecated():
        tf_psplugin.HybridOptions(**{knob: value})
    with pytest.raises(error, match=rf"{knob}.*Fix:"), deprecated():
        tf_psplugin.HybridOptions().replace(**{knob: value})


def test_options_are_frozen_and_replace_makes_a_changed_copy():
    options = tf_psplugin.HybridOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.stack_tables = False
    changed = options.replace(stack_tables=False, experimental_sparse_exchange="allgather")
    assert not changed.stack_tables and changed.experimental_sparse_exchange == "allgather"
    assert options.stack_tables and options.experimental_sparse_exchange == "ps"


def test_tables_are_stacked_by_default_and_stack_tables_false_is_the_way_out():
    assert tf_psplugin.HybridOptions().stack_tables
    with pytest.warns(DeprecationWarning):
        assert not options_lib.resolve(None, {"stack_tables": False}).stack_tables


def test_knobs_alone_change_the_defaults():
    with pytest.warns(DeprecationWarning):
        got = options_lib.resolve(None, {"experimental_fuse_lookups": True,
                                         "collective_timeout_seconds": 5})
    assert got == tf_psplugin.HybridOptions(experimental_fuse_lookups=True,
                                            collective_timeout_seconds=5)
    assert options_lib.resolve(None, {}) == tf_psplugin.HybridOptions()


def test_a_knob_given_twice_with_the_same_value_is_accepted():
    options = tf_psplugin.HybridOptions(stack_tables=False)
    with pytest.warns(DeprecationWarning, match="tuning knobs as keywords"):
        assert options_lib.resolve(options, {"stack_tables": False}) is options


def test_a_knob_given_twice_with_different_values_names_both():
    options = tf_psplugin.HybridOptions(stack_tables=False)
    with pytest.warns(DeprecationWarning), pytest.raises(
            tf_psplugin.StrategyError,
            match=r"options=HybridOptions\(stack_tables=False\), stack_tables=True\)"
                  r".*given twice.*Fix:"):
        options_lib.resolve(options, {"stack_tables": True})


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stak_tables'"):
        options_lib.resolve(None, {"stak_tables": True})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stak_tables'"):
        tf_psplugin.HybridOptions(stak_tables=True)


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
    with pytest.warns(DeprecationWarning, match="tuning knobs as keywords"), pytest.raises(
            tf_psplugin.StrategyError, match=r"connect_timeout_seconds is given twice"):
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


# -- the constructor's signature --------------------------------------------------------


def test_the_plugins_arguments_are_keyword_only_and_visible():
    params = inspect.signature(tf_psplugin.HybridParameterServerStrategy.__init__).parameters
    assert list(params)[:3] == ["self", "cluster_resolver", "variable_partitioner"]
    for name in ("options", "placement", "failover", "config"):
        assert params[name].kind == inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default is None, name
    fields = inspect.signature(tf_psplugin.HybridOptions).parameters
    assert set(options_lib.KNOBS) <= set(fields)
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in fields.values())


# -- deprecated spellings: they still work, and say what to write -----------------------


def test_a_knob_as_a_keyword_of_the_strategy_warns_naming_the_field():
    with pytest.warns(DeprecationWarning,
                      match=r"Fix: HybridParameterServerStrategy\(options=tf_psplugin."
                            r"HybridOptions\(stack_tables=False, log_placement=False\)\)"):
        got = options_lib.resolve(None, {"stack_tables": False, "log_placement": False})
    assert got == tf_psplugin.HybridOptions(stack_tables=False, log_placement=False)


def test_options_alone_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = tf_psplugin.HybridOptions(stack_tables=False, experimental_fuse_lookups=True)
        assert options_lib.resolve(options, {}) is options
        assert options_lib.resolve(None, {}) == tf_psplugin.HybridOptions()


@pytest.mark.parametrize("old,new,value,other", [
    ("sparse_exchange", "experimental_sparse_exchange", "allgather", "ps"),
    ("pack_on_read_updates", "experimental_pack_on_read_updates", False, True),
    ("fuse_lookups", "experimental_fuse_lookups", True, False),
])
def test_a_toggles_former_name_is_a_deprecated_alias(old, new, value, other):
    with pytest.warns(DeprecationWarning, match=rf"HybridOptions\({old}=\.\.\.\) is deprecated: "
                                                rf"use {new}="):
        options = tf_psplugin.HybridOptions(**{old: value})
    assert options == tf_psplugin.HybridOptions(**{new: value})
    with pytest.warns(DeprecationWarning, match=rf"read HybridOptions\.{new}"):
        assert getattr(options, old) == value
    with pytest.warns(DeprecationWarning, match=rf"use {new}="):
        assert tf_psplugin.HybridOptions().replace(**{old: value}) == options
    with pytest.warns(DeprecationWarning, match=rf"HybridOptions\({new}="):
        assert options_lib.resolve(None, {old: value}) == options
    # Both names, different values: which one is meant is not clear.
    with pytest.raises(ValueError, match=rf"{old}=.*{new}=.*same option.*Fix: pass only {new}"):
        tf_psplugin.HybridOptions(**{old: other, new: value})


def test_sharding_in_options_is_deprecated_for_placement_policy():
    with pytest.warns(DeprecationWarning,
                      match=r"HybridOptions\(sharding='contiguous'\) is deprecated.*"
                            r"placement=tf_psplugin.PlacementPolicy\(sharding='contiguous'\)"):
        options = tf_psplugin.HybridOptions(sharding="contiguous")
    assert options.sharding == "contiguous"


# -- combinations refused when the options are made --------------------------------------


@pytest.mark.parametrize("knobs,match", [
    ({"embedding_updates": "async", "experimental_sparse_exchange": "allgather"},
     r"embedding_updates='async', experimental_sparse_exchange='allgather'.*Fix: "
     r"embedding_updates='sync', or drop experimental_sparse_exchange"),
    ({"dense_placement": "ps", "experimental_sparse_exchange": "allgather"},
     r"dense_placement='ps', experimental_sparse_exchange='allgather'.*Fix: "
     r"dense_placement='allreduce', or drop experimental_sparse_exchange"),
    ({"dense_placement": "ps", "experimental_pack_on_read_updates": False},
     r"dense_placement='ps', experimental_pack_on_read_updates=False.*Fix: "
     r"dense_placement='allreduce', or drop experimental_pack_on_read_updates"),
    ({"dense_placement": "ps", "dense_allreduce_dtype": "bfloat16"},
     r"dense_placement='ps', dense_allreduce_dtype='bfloat16'.*Fix: "
     r"dense_placement='allreduce', or drop dense_allreduce_dtype"),
])
def test_a_combination_that_cannot_take_effect_is_refused(knobs, match):
    with pytest.raises(tf_psplugin.StrategyError, match=match):
        tf_psplugin.HybridOptions(**knobs)
    first, second = knobs.items()
    with pytest.raises(tf_psplugin.StrategyError, match=match):
        tf_psplugin.HybridOptions(**dict([first])).replace(**dict([second]))


@pytest.mark.parametrize("knobs", [
    {"embedding_updates": "async"},
    {"dense_placement": "ps"},
    {"dense_placement": "ps", "embedding_updates": "async", "stack_tables": False},
    {"experimental_sparse_exchange": "allgather", "experimental_pack_on_read_updates": False},
    {"embedding_updates": "async", "experimental_pack_on_read_updates": False},
    # The dense gradients in 16 bits, with async tables (still all-reduced) and buckets.
    {"dense_allreduce_dtype": "bfloat16"},
    {"dense_allreduce_dtype": "float16", "embedding_updates": "async"},
    {"dense_allreduce_dtype": "bfloat16", "dense_bucket_bytes": 262144},
])
def test_the_combinations_in_use_are_accepted(knobs):
    options = tf_psplugin.HybridOptions(**knobs)
    for name, value in knobs.items():
        assert getattr(options, name) == value


def test_the_strategy_refuses_sharding_given_twice_before_connecting():
    start = time.monotonic()
    with pytest.warns(DeprecationWarning), pytest.raises(
            tf_psplugin.StrategyError,
            match=r"HybridOptions\(sharding='contiguous'\), placement=PlacementPolicy\(sharding="
                  r"'interleaved'\)\).*given twice.*Fix:.*placement=PlacementPolicy"):
        tf_psplugin.HybridParameterServerStrategy(
            _resolver(), options=tf_psplugin.HybridOptions(sharding="contiguous"),
            placement=tf_psplugin.PlacementPolicy(sharding="interleaved"))
    assert time.monotonic() - start < 5.0


def test_the_strategy_refuses_failover_with_dense_variables_on_the_ps():
    start = time.monotonic()
    with pytest.raises(tf_psplugin.StrategyError,
                       match=r"dense_placement='ps'\), failover=FailoverPolicy\(enabled=True\)\)"
                             r".*no failover.*Fix: drop failover="):
        tf_psplugin.HybridParameterServerStrategy(
            _resolver(), options=tf_psplugin.HybridOptions(dense_placement="ps"),
            failover=tf_psplugin.FailoverPolicy())
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("kwargs", [
    {"placement": tf_psplugin.PlacementPolicy(sharding="contiguous")},
    {"failover": tf_psplugin.FailoverPolicy(enabled=False)},
])
def test_the_strategy_accepts_the_same_facts_said_once(kwargs):
    """Sharding only in the policy; a disabled failover with dense_placement='ps'."""
    options = tf_psplugin.HybridOptions(dense_placement="ps", connect_timeout_seconds=0.5)
    with pytest.raises(tf_psplugin.StrategyError, match="cannot reach"):
        tf_psplugin.HybridParameterServerStrategy(_resolver(), options=options, **kwargs)


def test_the_dense_gradients_travel_in_their_own_dtype_by_default():
    assert tf_psplugin.HybridOptions().dense_allreduce_dtype is None
    message = (r"dense_allreduce_dtype='half' is not supported\. "
               r"Fix: use one of None, 'bfloat16', 'float16'")
    with pytest.raises(tf_psplugin.StrategyError, match=message):
        tf_psplugin.HybridOptions(dense_allreduce_dtype="half")

