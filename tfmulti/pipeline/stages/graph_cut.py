"""Cuts a piece out of a traced graph as a function of chosen tensors.

A stage's forward and backward are traced together once; the schedule's actions each run a
piece of that graph (the forward, all gradients, or the input- and weight-gradient parts).
`GraphCut.function(feeds, fetches)` collects the ops that compute `fetches` from `feeds`
and imports just those (in C++, `import_graph_def`) into a `tf.function`: one call op in
the step's graph, traced once however many micro-batches call it. TensorFlow inlines the
calls before running the step, so the step computes exactly what a copy per micro-batch
would (kept as separate functions, the pieces are optimised apart from each other and round
differently).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf


def ops_between(
    fetches: Sequence[tf.Tensor],
    available: Callable[[tf.Tensor], bool],
    captures: set,
    also_run: Sequence[tf.Operation] = (),
) -> tuple[set, list[tf.Tensor]]:
    """The ops computing `fetches` (and running `also_run`) from tensors that are
    `available`, and those tensors.

    Captured tensors (variable handles) are neither: a cut function captures them itself.
    Control edges are not followed: between pieces, the schedule orders the calls.
    """
    ops, needs, seen_needs = set(), [], set()
    pending = [t.op for t in fetches] + list(also_run)
    while pending:
        op = pending.pop()
        if op in ops:
            continue
        ops.add(op)
        for tensor in op.inputs:
            if tensor.ref() in captures:
                continue
            if available(tensor):
                if tensor.ref() not in seen_needs:
                    seen_needs.add(tensor.ref())
                    needs.append(tensor)
            else:
                pending.append(tensor.op)
    return ops, needs


class GraphCut:
    """Makes functions out of pieces of one traced graph.

    Args:
        graph: the traced graph (e.g. a `wrap_function`'s), whose variable handles are
            captures.
        jit_compile: compile each function with XLA (on the device it is called on).
    """

    def __init__(self, graph, jit_compile: bool = False):
        self.jit_compile = jit_compile
        self._graph_def = graph.as_graph_def()
        self._nodes = {node.name: node for node in self._graph_def.node}
        self._order = {node.name: index for index, node in enumerate(self._graph_def.node)}
        self._captured = {internal.name: external for external, internal in graph.captures}
        self._capture_refs = {internal.ref() for internal in graph.internal_captures}

    def function(
        self,
        feeds: Sequence[tf.Tensor],
        fetches: Sequence[tf.Tensor],
        also_run: Sequence[tf.Operation] = (),
    ):
        """A concrete function from `feeds` to `fetches`, also running the `also_run` ops.

        Raises:
            ValueError: `fetches` depend on a graph input that is not among `feeds`.
        """
        fed = {t.ref() for t in feeds}
        ops, _ = ops_between(fetches, lambda t: t.ref() in fed, self._capture_refs, also_run)
        sub_graph = self._sub_graph_def({op.name for op in ops})
        feed_names = [t.name for t in feeds]
        fetch_names = [t.name for t in fetches]
        # Shapes set in Python (e.g. after a numpy_function) are not in the GraphDef.
        fetch_shapes = [t.shape for t in fetches]
        run_names = [op.name for op in also_run]
        captured = self._captured
        read = _tensors_read(sub_graph)

        def piece(*flat):
            input_map = {
                name: tensor for name, tensor in zip(feed_names, flat, strict=True) if name in read
            }
            # Variable handles are eager tensors; the function captures them as inputs.
            graph = tf.compat.v1.get_default_graph()
            input_map.update(
                (name, graph.capture(captured[name])) for name in read if name in captured
            )
            imported = tf.graph_util.import_graph_def(
                sub_graph, input_map=input_map, return_elements=fetch_names + run_names
            )
            results, ran = imported[: len(fetch_names)], imported[len(fetch_names) :]
            for result, shape in zip(results, fetch_shapes, strict=True):
                result.set_shape(shape)
            if not ran:
                return results
            with tf.control_dependencies(ran):
                return [tf.identity(t) for t in results]

        function = tf.function(piece, autograph=False, jit_compile=self.jit_compile)
        return function.get_concrete_function(*[tf.TensorSpec(t.shape, t.dtype) for t in feeds])

    def _sub_graph_def(self, names: set):
        """The nodes named `names`, in traced order, with edges to other nodes dropped."""
        sub_graph = tf.compat.v1.GraphDef()
        sub_graph.versions.CopyFrom(self._graph_def.versions)
        sub_graph.library.CopyFrom(self._graph_def.library)
        for name in sorted(names, key=self._order.__getitem__):
            node = sub_graph.node.add()
            node.CopyFrom(self._nodes[name])
            kept = [i for i in node.input if not i.startswith("^") or i[1:] in names]
            del node.input[:]
            node.input.extend(kept)
            if "_class" in node.attr:
                del node.attr["_class"]
            if node.op == "Placeholder":
                raise ValueError(
                    f"A piece of the stage's graph needs the graph input {name!r}, which "
                    "was not fed. Received feeds without it; this is a tfmulti bug."
                )
        return sub_graph


def _tensors_read(graph_def) -> set[str]:
    """Names (`op:index`) of the tensors that nodes of `graph_def` read."""
    read = set()
    for node in graph_def.node:
        for name in node.input:
            if not name.startswith("^"):
                read.add(name if ":" in name else f"{name}:0")
    return read
