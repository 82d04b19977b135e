"""A pipeline's forward alone (evaluate, predict) runs its micro-batches through one loop:
the traced step's stage calls do not grow with m, and the outputs equal the stages called
one after the other (equal micro-batches, uneven ones, nested outputs)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import Chain, dense_stages, regression_batches, two_tensor_stages

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.runtime.devices import logical_device_names

NUM_DEVICES = 4
CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")


class PairOutputs(keras.layers.Layer):
    """A last stage returning a dict of two tensors."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(7))

    def call(self, inputs):
        out = self.dense(inputs)
        return {"out": out, "twice": 2.0 * out}


def dict_output_stages(num_stages: int) -> list:
    return dense_stages(num_stages - 1) + [PairOutputs()]


def _pipeline(make_stages, num_microbatches):
    devices = logical_device_names("CPU")[:NUM_DEVICES]
    return PipelineModel(make_stages(NUM_DEVICES), devices, num_microbatches, "1f1b")


def _forward_graph(model, x) -> tf.compat.v1.GraphDef:
    @tf.function(autograph=False)
    def forward(x):
        return model(x, training=False)

    return forward.get_concrete_function(x).graph.as_graph_def()


def _ops(graph_def, names) -> int:
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(node.op in names for node in nodes)


def test_stage_calls_of_a_traced_forward_do_not_grow_with_microbatches():
    x = regression_batches(1, 64)[0][0]
    calls = {}
    for num_microbatches in (4, 16):
        model = _pipeline(dense_stages, num_microbatches)
        model(x[:2])
        graph_def = _forward_graph(model, x)
        assert _ops(graph_def, ("While", "StatelessWhile")) == 1
        calls[num_microbatches] = _ops(graph_def, CALL_OPS)
    assert calls[4] == calls[16]
    # Unrolled, 16 micro-batches would call the 4 stages 64 times.
    assert calls[16] < 16 * NUM_DEVICES
    # A batch that does not split into equal micro-batches is called part by part.
    uneven = _pipeline(dense_stages, 16)
    uneven(x[:2])
    graph_def = _forward_graph(uneven, x[:60])
    assert _ops(graph_def, ("While", "StatelessWhile")) == 0
    assert _ops(graph_def, CALL_OPS) >= 16 * NUM_DEVICES


@pytest.mark.parametrize("make_stages", [dense_stages, two_tensor_stages, dict_output_stages])
@pytest.mark.parametrize("rows", [64, 60])
def test_predict_and_evaluate_equal_the_stages_called_in_turn(make_stages, rows):
    x, y = regression_batches(1, rows)[0]
    pipeline = _pipeline(make_stages, 8)
    reference = Chain(make_stages(NUM_DEVICES))
    pipeline(x[:2])
    reference(x[:2])
    pipeline.set_weights(reference.get_weights())
    expected = reference.predict(x, batch_size=rows, verbose=0)
    got = pipeline.predict(x, batch_size=rows, verbose=0)
    tf.nest.assert_same_structure(got, expected)
    for mine, theirs in zip(tf.nest.flatten(got), tf.nest.flatten(expected), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)
    if make_stages is dict_output_stages:
        return
    for model in (pipeline, reference):
        model.compile(loss="mse", metrics=["mae"])
    np.testing.assert_allclose(
        pipeline.evaluate(x, y, batch_size=rows, verbose=0),
        reference.evaluate(x, y, batch_size=rows, verbose=0),
        rtol=1e-6,
    )
