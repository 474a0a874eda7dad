"""A table's initial rows drawn in row slices, equal bit for bit to the whole draw.

Why this module exists: Keras asks for a table's initial value in float32,
so a half-precision table's rows are drawn in float32 and then cast. Drawn
whole on its PS, a bfloat16 shard needs the float32 draw beside its own
rows (3x its size; a float32 shard needs its draw and the draw's scaled
copy, 2x). Drawn slice by slice into the variable, the PS holds the rows
in their own dtype plus one float32 slice (`SLICE_BYTES`).

The slices must give the values the whole draw gives, since a job's
initial table must not depend on how it is stored or sharded. Keras's
random initializers (`RandomUniform`, Embedding's default "uniform",
`RandomNormal`, `TruncatedNormal`, `GlorotUniform` and the other
`VarianceScaling` ones, seeded or not: unseeded, Keras picks the seed in
Python) draw with TensorFlow's stateless Philox ops, whose element ``i``
depends on the key and the counter advanced by ``i // 4`` steps
(`StatelessRandomUniformV2`, `StatelessRandomNormalV2`: 4 float32 per
step) or ``(i // 4) * 256`` steps (`StatelessTruncatedNormalV2` reserves
256 steps per group of 4 for its rejection sampling), not on the shape.
So rows ``[a, b)`` of a ``[V, W]`` draw, ``a * W`` a multiple of 4, are the
draw of shape ``[b - a, W]`` from the counter advanced accordingly
(checked bit for bit on TF 2.15.1 and 2.21.0 by
tests/unit/test_sliced_draw.py), and Keras's scaling after the draw is
element-wise.

`trace` traces an initial-value callable once; `slicer` accepts its graph
only if the value is one such draw, or a fill of one value (`Zeros`,
`Constant`), followed by element-wise ops with scalars (the scaling, the
cast to the table's dtype). Any other graph (a stateful op, a captured
tensor, an op that is not element-wise, a draw in another dtype) gives
None, and the caller keeps the whole value: the traced function, so the
initializer is called once either way. Only public TensorFlow APIs are
used (`tf.graph_util.import_graph_def` replays the traced graph for each
slice with the slice's shape and counter).
"""

from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

# A slice of rows holds at most this many bytes of float32 draw.
SLICE_BYTES = 8 << 20

# The stateless draws that can be sliced: Philox counter steps per group of
# 4 float32 elements (TF's random_op_cpu.h: a fixed 4 samples per step, or
# 256 steps reserved per group for the rejection-sampled truncated normal).
_COUNTER_STEPS_PER_GROUP = {
    "StatelessRandomUniformV2": 1,
    "StatelessRandomNormalV2": 1,
    "StatelessTruncatedNormalV2": 256,
}
_GROUP = 4
# Ops whose output element i depends only on element i of their full-shaped
# inputs (their other inputs must be scalars).
_ELEMENTWISE = frozenset({
    "Identity", "Cast", "Mul", "AddV2", "Add", "Sub", "RealDiv", "Neg", "Maximum", "Minimum",
})
_UINT64_MASK = (1 << 64) - 1


def trace(fn, dtype: tf.DType) -> tf.types.experimental.ConcreteFunction:
    """``fn()`` as a `dtype` tensor, traced once (the whole value; `slicer` reads its graph)."""

    @tf.function(autograph=False)
    def value():
        return tf.convert_to_tensor(fn(), dtype=dtype)

    return value.get_concrete_function()


def slicer(whole: tf.types.experimental.ConcreteFunction, shape) -> Optional["Slicer"]:
    """A `Slicer` that writes `whole`'s value slice by slice, or None if it cannot be sliced.

    Args:
        whole: A traced zero-argument value (`trace`).
        shape: The value's shape, fully defined, rank >= 1.

    Returns:
        The slicer, or None when the value is not a stateless draw or a fill
        followed by element-wise ops with scalars (see the module doc).
    """
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank < 1 or not shape.is_fully_defined():
        return None
    graph = whole.graph
    if len(graph.outputs) != 1 or graph.inputs:
        return None
    for op in graph.get_operations():
        if op.type == "Placeholder" or op.op_def.is_stateful:
            return None
    full = shape.as_list()
    draws, fills, consts = set(), set(), {}

    def accepts(t: tf.Tensor) -> bool:
        if t.shape.rank is None:
            return False
        if t.shape.rank == 0:
            return True
        if t.shape.as_list() != full:
            return False
        op = t.op
        if op.type in _COUNTER_STEPS_PER_GROUP:
            draws.add(op)
            return op.get_attr("dtype") == tf.float32 and _is_philox(op.inputs[3])
        if op.type == "Fill":
            fills.add(op)
            return True
        if op.type == "Const":
            value = _broadcast_scalar(op)
            consts[op] = value
            return value is not None
        if op.type in _ELEMENTWISE:
            return all(accepts(i) for i in op.inputs)
        return False

    if not accepts(graph.outputs[0]) or len(draws) > 1:
        return None
    graph_def = graph.as_graph_def()
    if graph_def.library.function:
        return None
    by_name = lambda item: item[0].name if isinstance(item, tuple) else item.name  # noqa: E731
    return Slicer(graph_def, graph.outputs[0], full, next(iter(draws), None),
                  sorted(fills, key=by_name), sorted(consts.items(), key=by_name))


def _is_philox(alg: tf.Tensor) -> bool:
    """Whether a draw's algorithm input is a constant Philox (1) or auto-select (3).

    Auto-select (Keras's choice) is Philox on CPU and GPU; `Slicer`'s
    counter arithmetic is Philox's.
    """
    if alg.op.type != "Const":
        return False
    values = list(alg.op.get_attr("value").int_val)
    return values in ([1], [3])


def _broadcast_scalar(op) -> Optional[np.ndarray]:
    """The one value a Const op of many elements repeats (Keras's `Constant`), or None."""
    proto = op.get_attr("value")
    if proto.tensor_content:
        return None
    fields = ("float_val", "double_val", "half_val", "int_val", "int64_val", "bool_val")
    if sum(len(getattr(proto, f)) for f in fields) != 1:
        return None
    scalar = type(proto)()
    scalar.CopyFrom(proto)
    scalar.tensor_shape.Clear()
    return tf.make_ndarray(scalar)


class Slicer:
    """Writes a traced value into a variable of its shape, one slice of rows at a time.

    Made by `slicer`. Example (``var`` uninitialized, on the device):

    ```python
    whole = sliced_draw.trace(init, tf.bfloat16)
    s = sliced_draw.slicer(whole, var.shape)
    if s is not None:
        s.fill(var)
    else:
        var.assign(whole())
    ```
    """

    def __init__(self, graph_def, output: tf.Tensor, shape: List[int], draw, fills, consts):
        self._graph_def = graph_def
        self._output = output.name
        self._dtype = output.dtype
        self._shape = shape
        self._width = int(np.prod(shape[1:], dtype=np.int64))
        self._draw = draw
        self._fills = fills
        self._consts = consts

    def slices(self) -> List[Tuple[int, int]]:
        """(first row, rows) of each slice: each first row times the width is a multiple of 4."""
        rows = self._shape[0]
        per = max(_GROUP, SLICE_BYTES // (4 * self._width) // _GROUP * _GROUP)
        return [(a, min(per, rows - a)) for a in range(0, rows, per)]

    def _offsets(self, starts) -> np.ndarray:
        """How far each slice's Philox counter is from the draw's (two uint64, low first)."""
        steps = _COUNTER_STEPS_PER_GROUP[self._draw.type] if self._draw is not None else 0
        offsets = [a * self._width // _GROUP * steps for a in starts]
        return np.array([[o & _UINT64_MASK, o >> 64] for o in offsets], dtype=np.uint64)

    def _base_counter(self) -> tf.Tensor:
        """The whole draw's Philox counter, computed by the traced graph's ops (uint64 [2])."""
        if self._draw is None:
            return tf.zeros([2], tf.uint64)
        # The draw itself is pruned (not fetched); a tiny shape keeps it so if it were not.
        tiny = tf.constant([1] * len(self._shape), self._draw.inputs[0].dtype)
        return tf.graph_util.import_graph_def(
            self._graph_def, input_map={self._draw.inputs[0].name: tiny},
            return_elements=[self._draw.inputs[2].name], name="counter")[0]

    def _value(self, rows: tf.Tensor, counter: tf.Tensor) -> tf.Tensor:
        """The traced value's ops for `rows` rows, drawn from `counter`."""
        shape = tf.concat([tf.reshape(rows, [1]), tf.constant(self._shape[1:], tf.int64)], 0)
        input_map = {}
        if self._draw is not None:
            input_map[self._draw.inputs[0].name] = tf.cast(shape, self._draw.inputs[0].dtype)
            input_map[self._draw.inputs[2].name] = counter
        for op in self._fills:
            input_map[op.inputs[0].name] = tf.cast(shape, op.inputs[0].dtype)
        for op, scalar in self._consts:
            input_map[op.outputs[0].name] = tf.fill(shape, tf.constant(scalar, op.outputs[0].dtype))
        return tf.graph_util.import_graph_def(self._graph_def, input_map=input_map,
                                              return_elements=[self._output], name="slice")[0]

    def value(self) -> tf.Tensor:
        """The whole value, built slice by slice on the current device."""

        @tf.function(autograph=False)
        def run(*args):
            return self._build(*args)

        return run(*self._arguments())

    def fill(self, var: tf.Variable) -> None:
        """Assigns the value, built slice by slice, to `var` (of its shape and dtype)."""

        @tf.function(autograph=False)
        def run(*args):
            var.assign(self._build(*args), read_value=False)

        with tf.device(var.device):
            run(*self._arguments())

    def _arguments(self) -> List[tf.Tensor]:
        # Shapes, rows and counter offsets are passed as arguments, not
        # constants: Grappler would otherwise fold the fills and draws.
        slices = self.slices()
        starts = [a for a, _ in slices]
        return [tf.constant(self._shape, tf.int64), tf.constant(starts, tf.int64),
                tf.constant([n for _, n in slices], tf.int64),
                tf.constant(self._offsets(starts))]

    def _build(self, shape, starts, counts, offsets) -> tf.Tensor:
        """In a tf.function: the value, each slice written into one buffer in turn.

        The loop's tensor is updated in place (`TensorStridedSliceUpdate`
        forwards its input's buffer; one iteration at a time), so the peak
        is the value plus one slice's draw. A variable updated by slices
        instead would enter copy-on-read mode, and its read would copy it.
        """
        base = self._base_counter()
        rest = tf.constant(self._shape[1:], tf.int64)
        zeros = tf.zeros_like(rest)
        ones = tf.ones([len(self._shape)], tf.int64)

        def body(i, rows):
            start, count = starts[i], counts[i]
            begin = tf.concat([tf.reshape(start, [1]), zeros], 0)
            end = tf.concat([tf.reshape(start + count, [1]), rest], 0)
            return i + 1, tf.raw_ops.TensorStridedSliceUpdate(
                input=rows, begin=begin, end=end, strides=ones,
                value=self._value(count, _advance(base, offsets[i])))

        first = tf.zeros(shape, self._dtype)
        return tf.while_loop(lambda i, _: i < tf.size(starts), body, [tf.constant(0), first],
                             parallel_iterations=1)[1]


def _advance(counter: tf.Tensor, offset: tf.Tensor) -> tf.Tensor:
    """The 128-bit Philox `counter` (two uint64, low first) plus `offset` (same form)."""
    low = counter[0] + offset[0]
    carry = tf.cast(low < offset[0], tf.uint64)
    return tf.stack([low, counter[1] + offset[1] + carry])
