"""Instance-key bookkeeping of `CollectiveGroup` (no cluster needed).

The coordinator traces one copy of a synchronous step per worker; the copies
of one collective must carry the same instance key, and collectives of
different functions must not share one.
"""

import tensorflow as tf

from tf_psplugin.sync.collectives import CollectiveGroup


def _keys_of_trace(group, n):
    keys = []

    @tf.function(autograph=False)
    def step():
        for _ in range(n):
            keys.append(group.next_instance_key())
        return tf.constant(0)

    step.get_concrete_function()
    return keys


def test_every_trace_in_a_block_gets_the_same_keys():
    group = CollectiveGroup(2)
    before = _keys_of_trace(group, 2)
    with group.same_keys_per_trace():
        per_worker = [_keys_of_trace(group, 3) for _ in range(3)]
    after = _keys_of_trace(group, 1)
    assert per_worker[0] == per_worker[1] == per_worker[2]
    assert len(set(per_worker[0])) == 3
    # Keys of other functions never collide with the block's.
    assert not set(before) & set(per_worker[0])
    assert after[0] > max(per_worker[0])


def test_a_block_without_traces_uses_no_keys():
    group = CollectiveGroup(2)
    first = _keys_of_trace(group, 1)
    with group.same_keys_per_trace():
        pass
    assert _keys_of_trace(group, 1) == [first[0] + 1]


def test_a_longer_trace_moves_the_counter_past_its_keys():
    group = CollectiveGroup(2)
    with group.same_keys_per_trace():
        short = _keys_of_trace(group, 1)
        long = _keys_of_trace(group, 4)
    assert long[0] == short[0]
    assert _keys_of_trace(group, 1)[0] == long[-1] + 1
