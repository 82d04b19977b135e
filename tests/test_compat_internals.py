"""Canaries: each named function over a private Keras or TensorFlow internal still works
on the installed versions (`tfmulti/compat/keras_internals.py`, `tf_internals.py`)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmulti  # noqa: F401
from tfmulti.compat import keras_internals, tf_internals


def _functional():
    inputs = keras.Input((3,), name="features")
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="logits")(hidden)
    return keras.Model(inputs, outputs, name="small")


def test_installed_versions_are_the_checked_ones():
    assert keras_internals.is_checked_keras()
    assert tf_internals.is_checked_tensorflow()


def test_a_missing_internal_fails_with_one_line_naming_the_version():
    with pytest.raises(keras_internals.MissingKerasInternal, match=keras.version()) as error:
        keras_internals._private(object(), "_gone", "Layer._gone")
    assert "\n" not in str(error.value)
    with pytest.raises(tf_internals.MissingTensorFlowInternal, match=tf.__version__):
        tf_internals._private(object(), "_gone", "Operation._gone")


def test_layers_within_walks_nested_layers():
    inner = _functional()
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1, name="head")])
    names = [layer.name for layer in keras_internals.layers_within(outer)]
    assert names[0] == outer.name and {"small", "hidden", "logits", "head"} <= set(names)
    assert outer not in keras_internals.layers_within(outer, include_self=False)


def test_loss_ids_name_the_losses_a_layer_added():
    class Regularised(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            return x

    layer = Regularised()
    with keras.StatelessScope(collect_losses=True) as scope:
        layer(np.ones((2, 3), "float32"))
        assert keras_internals.loss_ids(layer) == {id(loss) for loss in scope.losses}


def test_keras_mask_round_trips():
    tensor = tf.ones((2, 3))
    assert keras_internals.keras_mask(tensor) is None
    mask = tf.constant([[True, False, True]] * 2)
    keras_internals.attach_keras_mask(tensor, mask)
    assert keras_internals.keras_mask(tensor) is mask
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(tf.constant([[1, 0]]))
    assert keras_internals.keras_mask(embedded).numpy().tolist() == [[True, False]]


def test_variable_storage_reinitialize_and_deferred_creation():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    storage = keras_internals.variable_storage(layer.kernel)
    assert isinstance(storage, tf.Variable)
    assert keras_internals.variable_storage(tf.Variable(1.0)) is None
    value = np.arange(6, dtype="float32").reshape(3, 2)
    with tf.device("/CPU:0"):
        keras_internals.reinitialize_variable(layer.kernel, tf.constant(value))
    np.testing.assert_array_equal(layer.kernel.numpy(), value)
    assert keras_internals.variable_storage(layer.kernel) is not storage

    created = keras.Variable(np.ones(2, "float32"))
    keras_internals.initialize_deferred_on_device(created, "/CPU:0")  # already made: unchanged
    np.testing.assert_array_equal(created.numpy(), [1.0, 1.0])
    with keras.StatelessScope():
        deferred = keras.Variable(keras.initializers.Ones(), shape=(2,))
        assert keras_internals.variable_storage(deferred) is None
        keras_internals.initialize_deferred_on_device(deferred, "/CPU:0")
    # Leaving the scope creates the deferred variables.
    assert "CPU:0" in keras_internals.variable_storage(deferred).device


def test_functional_model_internals():
    model = _functional()
    assert keras_internals.is_functional(model) and keras_internals.is_plain_functional(model)
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert not keras_internals.is_plain_functional(sequential)
    assert keras_internals.graph_run_by(model) is model
    assert keras_internals.is_functional(keras_internals.graph_run_by(sequential))
    assert keras_internals.graph_run_by(keras.layers.Dense(2)) is None

    by_depth = keras_internals.nodes_by_depth(model)
    deepest = by_depth[max(by_depth)]
    assert [node.is_input for node in deepest] == [True]
    assert keras_internals.inputs_structure(model) is model.inputs[0]
    assert keras_internals.outputs_structure(model) is model.outputs[0]

    x = np.ones((2, 3), "float32")
    flat = keras_internals.standardize_inputs(model, {"features": x})
    assert len(flat) == 1 and np.asarray(flat[0]).shape == (2, 3)
    outputs = keras_internals.run_through_graph(model, [tf.constant(x)], lambda op: op)
    np.testing.assert_allclose(outputs.numpy(), model(x).numpy(), rtol=1e-6)
    assert keras_internals.unpack_singleton([outputs]) is outputs


def test_operation_call_passes_training_to_operations_that_take_it():
    dropout = keras.layers.Dropout(0.5)
    x = np.ones((100, 10), "float32")
    assert np.all(keras_internals.operation_call(dropout)(x).numpy() == 1.0)
    assert np.any(keras_internals.operation_call(dropout, training=True)(x).numpy() == 0.0)


def test_operation_wrapping_functional_wraps_every_operation():
    class Recording(keras_internals.OperationWrappingFunctional, keras.Model):
        def wrap_operation(self, operation, function):
            getattr(self, "called", []).append(operation.name)
            return function

    model = _functional()
    wrapped = Recording(model.input, model.output)
    wrapped.called = []
    wrapped(np.ones((2, 3), "float32"))
    assert wrapped.called == ["hidden", "logits"]


def test_compute_loss_and_track_loss():
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((2, 3), "float32"), np.zeros((2, 2), "float32")
    loss = keras_internals.compute_loss(model, x, y, model(x))
    np.testing.assert_allclose(float(loss), float(np.mean(model(x).numpy() ** 2)), rtol=1e-5)
    keras_internals.track_loss(model, tf.constant(3.0), sample_weight=2)
    assert float(model.metrics[0].result()) == pytest.approx(3.0)


def test_symbolic_builds_make_metrics_loss_and_optimizer_without_a_step():
    x, y = np.ones((2, 3), "float32"), np.zeros((2, 2), "float32")
    batch = tuple(keras.KerasTensor((None, *v.shape[1:]), "float32") for v in (x, y))
    model = _functional()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    keras_internals.symbolic_build(model, batch)
    assert model.optimizer.built and keras_internals.compiled_metrics(model).built
    model = _functional()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    y_pred = keras.KerasTensor((None, 2), "float32")
    keras_internals.build_compiled_metrics_and_loss(model, *batch, y_pred, None)
    assert keras_internals.compiled_metrics(model).built and model._compile_loss.built
    assert not model.optimizer.built
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    epochs = TFEpochIterator(
        x=tf.data.Dataset.from_tensor_slices((x, y)).batch(2),
        distribute_strategy=tf.distribute.get_strategy(),
    )
    assert keras_internals.epoch_dataset(epochs).element_spec[0].shape.as_list() == [None, 3]


def test_learning_rate_setting_keeps_the_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert keras_internals.learning_rate_setting(keras.optimizers.SGD(schedule)) is schedule
    setting = keras_internals.learning_rate_setting(keras.optimizers.SGD(0.25))
    assert float(np.asarray(setting)) == pytest.approx(0.25)


def test_tape_recording_functions():
    x = tf.constant(2.0)
    assert not tf_internals.any_tape_recording()
    with tf.GradientTape() as tape:
        tape.watch(x)
        assert tf_internals.any_tape_recording()
        assert tf_internals.should_record_backprop([x])
        with tf_internals.stop_recording():
            assert not tf_internals.should_record_backprop([x])
            assert not tf_internals.any_tape_recording()
        y = x * 1.0
        tf_internals.record_operation("triple", [y], [x], lambda dy: [3.0 * dy])
    assert float(tape.gradient(y, x)) == 3.0


def test_all_reduce_v2_sums_over_a_group():
    @tf.function
    def total(value):
        return tf_internals.all_reduce_v2(value, group_size=1, group_key=901, instance_key=1)

    assert float(total(tf.constant(4.0))) == 4.0


def test_is_stateful_tells_variable_ops_from_math():
    variable = tf.Variable(1.0)

    @tf.function
    def step():
        variable.assign_add(1.0)
        return tf.constant(2.0) * 3.0

    graph = step.get_concrete_function().graph
    stateful = {op.type for op in graph.get_operations() if tf_internals.is_stateful(op)}
    assert "AssignAddVariableOp" in stateful and "Mul" not in stateful


def test_multi_worker_strategy_on_logical_cpus_extends_the_strategy_class():
    import inspect

    source = inspect.getsource(tf_internals.multi_worker_strategy_on_logical_cpus)
    assert "CollectiveAllReduceExtended" in source
    from tensorflow.python.distribute import collective_all_reduce_strategy

    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    parameters = inspect.signature(extended._initialize_local_devices).parameters
    assert list(parameters) == ["self", "cluster_resolver", "worker_device"]


def test_step_trace_accepts_the_root_flag():
    with tf_internals.step_trace("train", 3):
        tf.constant(1.0) + 1.0


def test_stop_peer_preemption_watcher_calls_the_handlers_own_stop():
    # A handler with no watcher thread (as on one process): the stop does nothing. A multi-
    # worker run ending it: tests/test_train_script_parallel.py, a worker that ends after
    # the chief.
    handler_class = tf.distribute.experimental.PreemptionCheckpointHandler
    handler = handler_class.__new__(handler_class)
    tf_internals.stop_peer_preemption_watcher(handler)
    with pytest.raises(tf_internals.MissingTensorFlowInternal, match=tf.__version__):
        tf_internals.stop_peer_preemption_watcher(object())
