"""Graph helpers shared by the chief scripts that check a traced step's op order.

Imported by sync_equivalence.py and dynamic_embedding.py (this directory is
their sys.path[0]).
"""

import tensorflow as tf


def traced_graphs(model, branches=False):
    """Every traced graph of the train function, with its while-loop bodies.

    With `branches`, also every tf.cond branch (such as those of Keras's
    LossScaleOptimizer: apply the step, or skip it).
    """
    fn = next(c.cell_contents for c in model.train_function.__closure__
              if isinstance(c.cell_contents, tf.types.experimental.GenericFunction))

    def graphs_of(graph):  # The graph and its while-loop bodies (steps_per_execution > 1).
        yield graph
        for op in graph.get_operations():
            # Set by while_v2, and by cond_v2.
            names = ("_body_graph", "_true_graph", "_false_graph") if branches else (
                "_body_graph",)
            for name in names:
                nested = getattr(op, name, None)
                if nested is not None:
                    yield from graphs_of(nested)

    for c in fn._list_all_concrete_functions():  # pylint: disable=protected-access
        yield from graphs_of(c.graph)


def ancestors(op):
    """Names of `op` and every op it depends on (data and control inputs)."""
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        if o.name in seen:
            continue
        seen.add(o.name)
        todo.extend(t.op for t in o.inputs)
        todo.extend(o.control_inputs)
    return seen
