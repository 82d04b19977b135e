"""Pipeline stages from a whole Keras model: its call graph, cut where the partition says."""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmulti.costing.cost_cache import CostCache
from tfmulti.costing.model_graph import call_graph, functional_view
from tfmulti.pipeline.stages.graph_partition import choose_boundaries
from tfmulti.pipeline.stages.graph_stages import GraphStage, graph_stages


def stages_from_model(
    model: keras.Model,
    num_stages: int,
    partition: str | Sequence[str] = "params",
    num_microbatches: int = 1,
    schedule: object = "1f1b",
    sample_input=None,
    cost_cache: CostCache | None = None,
) -> list[GraphStage]:
    """Cuts a functional or Sequential model into `num_stages` stages sharing its layers.

    Nested functional models are opened, so cuts may fall between their layers. The
    stages hold the model's own (built) layers; the pipeline moves their variables.

    Args:
        model: a functional model or a Sequential; an unbuilt Sequential is built on
            `sample_input` first.
        num_stages: stages to make (devices times chunks).
        partition: see `choose_boundaries`.
        num_microbatches: micro-batches per step, for the "time" policy's simulation.
        schedule: the pipeline's schedule, for the "time" policy's simulation.
        sample_input: one micro-batch of model input; "time" and "memory" make one from
            the model's input specs when None and every input axis but the batch is known.
        cost_cache: call timings kept between runs, for the "time" policy.

    Example:
        >>> stages = stages_from_model(model, 4, partition="params")
    """
    if isinstance(model, keras.Sequential) and not model.built:
        if sample_input is None:
            raise ValueError(
                f"Sequential model {model.name!r} is not built, so it has no graph to cut. "
                "Received: sample_input=None; pass sample_input=one batch of model input, "
                "or call model.build(input_shape) first."
            )
        model(tf.nest.map_structure(tf.convert_to_tensor, sample_input))
    functional = functional_view(model)
    graph = call_graph(functional, open_nested=True)
    boundaries = choose_boundaries(
        functional,
        graph,
        num_stages,
        partition,
        num_microbatches,
        schedule,
        sample_input,
        cost_cache,
    )
    return graph_stages(functional, graph, boundaries)
