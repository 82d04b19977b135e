"""Pipeline and hybrid steps are optimised by one Grappler iteration, not TensorFlow's
default two (their graphs hold inlined copies of the stages; the second pass costs as much
as the first and changes little), and other models keep the default."""

import os
import subprocess
import sys
import textwrap

from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context

from tfmulti.pipeline.runtime.grappler_iterations import (
    call_config,
    one_grappler_iteration,
    optimised_once,
)

ONE = rewriter_config_pb2.RewriterConfig.ONE
TWO = rewriter_config_pb2.RewriterConfig.TWO
DEFAULT = rewriter_config_pb2.RewriterConfig.DEFAULT_NUM_ITERS
TESTS = os.path.dirname(os.path.abspath(__file__))


def _iterations() -> int:
    return call_config().graph_options.rewrite_options.meta_optimizer_iterations


def test_one_iteration_inside_and_the_default_again_after():
    assert _iterations() == DEFAULT
    with one_grappler_iteration():
        assert _iterations() == ONE
    assert _iterations() == DEFAULT
    seen = []
    wrapped = optimised_once(lambda value: seen.append(_iterations()) or value + 1)
    assert wrapped(1) == 2 and seen == [ONE]
    assert optimised_once(wrapped) is wrapped and optimised_once(None) is None


def test_an_iteration_count_the_user_set_is_kept():
    ctx = context.context()
    saved = ctx.function_call_options
    config = call_config()
    config.graph_options.rewrite_options.meta_optimizer_iterations = TWO
    ctx.function_call_options = context.FunctionCallOptions(config_proto=config)
    try:
        with one_grappler_iteration():
            assert _iterations() == TWO
    finally:
        ctx.function_call_options = saved


PROGRAM = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from tfmulti.platform.runtime.devices import configure_logical_devices, logical_device_names
    configure_logical_devices(2, device_type="CPU")
    from pipeline_runtime_models import Chain, dense_stages, regression_batches
    from tfmulti.pipeline.runtime import PipelineModel
    x, y = regression_batches(1, 16)[0]
    pipeline = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 4, "1f1b")
    for name, model in (("plain", Chain(dense_stages(2))), ("pipeline", pipeline)):
        print("MODEL", name, file=sys.stderr, flush=True)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        model.evaluate(x, y, batch_size=16, verbose=0)
    """
)


def _constant_folding_passes_per_step_function(stderr: str) -> dict[str, list[int]]:
    """For each model, the constant-folding passes Grappler logged for each of its step
    functions (Keras' `multi_step_on_iterator`), in order."""
    passes, model, item = {}, None, None
    for line in stderr.splitlines():
        if line.startswith("MODEL "):
            model, item = line.split()[1], None
            passes[model] = []
        elif "Starting optimization for grappler item:" in line:
            item = "multi_step_on_iterator" in line
            if item:
                passes[model].append(0)
        elif item and "] constant_folding:" in line:
            passes[model][-1] += 1
    return passes


def test_fit_and_evaluate_of_a_pipeline_run_one_grappler_iteration_a_plain_model_two():
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="meta_optimizer=1")
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(tests=TESTS)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    passes = _constant_folding_passes_per_step_function(result.stderr)
    # fit's and evaluate's step functions; Keras' own model is left at the default.
    assert passes == {"plain": [2, 2], "pipeline": [1, 1]}
