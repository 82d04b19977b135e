"""Step checkpoints hold a model's whole training state, whatever its `save_weights` exports:
a `from_model` pipeline resumes with its optimizer state, not only the user model's weights."""

import keras
import numpy as np
from pipeline_graph_models import regression_data, skip_model

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.runtime.devices import first_logical_devices
from tfmulti.run.step_checkpoint import ResumePoint, restore
from tfmulti.run.training_state import save_training_state

BATCH = 8


def _pipeline():
    pipe = PipelineModel.from_model(skip_model(), first_logical_devices(2, "stages"), 2, "1f1b")
    pipe.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    return pipe


def test_a_from_model_pipeline_resumes_with_its_optimizer_state(tmp_path):
    x, y = regression_data(skip_model(), 3 * BATCH)
    trained = _pipeline()
    for step in range(2):
        trained.train_on_batch(
            x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        )
    path = str(tmp_path / "state.weights.h5")
    save_training_state(trained, path)

    resumed = _pipeline()
    resumed(x[:BATCH])
    restore(resumed, ResumePoint(epoch=0, step=2, global_step=2, weights_path=path, state={}))
    assert int(resumed.optimizer.iterations.numpy()) == 2
    for pipe in (trained, resumed):
        pipe.train_on_batch(x[2 * BATCH :], y[2 * BATCH :])
    # Adam's third update depends on the moments of the first two: without them the
    # weights would part at once.
    for expected, actual in zip(trained.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)
