"""`IdentityMap`: entries keyed by identity, gone when their key is collected."""

import gc

import pytest
import tensorflow as tf

from tf_psplugin._internal.identity import IdentityMap


class Thing:
    pass


def test_keys_are_identities_and_entries_die_with_them():
    owners = IdentityMap()
    a, b = tf.Variable(1.0), tf.Variable(1.0)  # Unhashable, equal values.
    owners[a] = 0
    owners[b] = 1
    assert owners[a] == 0 and owners.get(b) == 1 and a in owners
    assert len(owners) == 2
    del a
    gc.collect()
    assert len(owners) == 1 and owners.get(b) == 1


def test_a_new_object_never_inherits_a_dead_objects_entry():
    seen = IdentityMap()
    for _ in range(200):  # CPython reuses freed ids quickly.
        t = Thing()
        assert t not in seen and seen.get(t) is None
        seen[t] = "old"
        del t
    gc.collect()
    assert len(seen) == 0


def test_pop_and_missing_keys():
    m = IdentityMap()
    t = Thing()
    with pytest.raises(KeyError):
        m[t]  # pylint: disable=pointless-statement
    m[t] = 5
    assert m.pop(t) == 5 and m.pop(t, None) is None and t not in m
    m[t] = 6  # Set again after a pop: the first finalizer must not drop it.
    assert list(m.values()) == [6]


def test_setting_a_key_again_adds_no_finalizer():
    import weakref  # pylint: disable=g-import-not-at-top

    m = IdentityMap()
    t = Thing()
    for i in range(50):
        m[t] = i
    assert m[t] == 49
    finalizers = [f for f in weakref.finalize._registry if f.peek() and f.peek()[0] is t]
    assert len(finalizers) == 1
