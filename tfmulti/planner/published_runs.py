"""Published thousand-GPU runs, and the cluster planner's predictions held against them.

Pure Python. Megatron-LM's Table 1 (Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC'21): GPT models of vocabulary
51,200 and sequence 2,048 on DGX A100 80 GB nodes, mixed precision, full activation
recomputation. For each row, the planner scores the published (tensor, pipeline) layout
(its best micro-batch size, schedule and chunks) and searches every layout; a row holds
when the published layout's predicted step is within `BEST_GAP` of the predicted best.
"""

from __future__ import annotations

import dataclasses

from tfmulti.planner.cluster_search import search_cluster_layouts
from tfmulti.planner.hardware_files import ClusterHardware
from tfmulti.planner.model_shapes import gpt_shape
from tfmulti.platform.mesh import HybridMesh

SEQUENCE = 2048
VOCABULARY = 51200
# The published layout is among the planner's best when its step is within this share.
BEST_GAP = 0.05


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One row of Megatron-LM's Table 1."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipe: int
    gpus: int
    batch: int
    tflops_per_gpu: float

    @property
    def mesh(self) -> HybridMesh:
        return HybridMesh(
            data=self.gpus // (self.tensor * self.pipe), pipe=self.pipe, tensor=self.tensor
        )


MEGATRON_TABLE_1 = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def compare_run(run: PublishedRun, hardware: ClusterHardware) -> dict:
    """The planner's prediction for `run`'s layout, and where that layout ranks."""
    shape = gpt_shape(run.layers, run.hidden, run.heads, SEQUENCE, VOCABULARY)
    published = search_cluster_layouts(shape, hardware, run.gpus, run.batch, layout=run.mesh)
    searched = search_cluster_layouts(shape, hardware, run.gpus, run.batch)
    fitting = [item for item in published if item.fits]
    chosen = fitting[0] if fitting else published[0]
    best = searched[0]
    gap = chosen.layout.step_time / best.layout.step_time - 1
    meshes = []
    for item in searched:
        if item.layout.mesh not in meshes:
            meshes.append(item.layout.mesh)
    return {
        "billions": run.billions,
        "tensor": run.tensor,
        "pipe": run.pipe,
        "gpus": run.gpus,
        "batch": run.batch,
        "published_tflops_per_gpu": run.tflops_per_gpu,
        "predicted_tflops_per_gpu": chosen.tflops_per_device,
        "error": chosen.tflops_per_device / run.tflops_per_gpu - 1,
        "published_layout_fits": chosen.fits,
        "published_layout_memory_per_gpu": chosen.layout.peak_memory,
        "published_layout": chosen.to_json(),
        "best_layout": best.to_json(),
        "gap_to_best": gap,
        "published_mesh_rank": meshes.index(run.mesh) + 1 if run.mesh in meshes else None,
        "published_among_best": gap <= BEST_GAP,
    }


def compare_published(hardware: ClusterHardware, runs=MEGATRON_TABLE_1) -> dict:
    """Every run's comparison, the MAPE of TFLOP/s per GPU, and how many rows hold."""
    rows = [compare_run(run, hardware) for run in runs]
    return {
        "rows": rows,
        "mape": sum(abs(row["error"]) for row in rows) / len(rows),
        "published_among_best": sum(row["published_among_best"] for row in rows),
        "published_layouts_fit": sum(row["published_layout_fits"] for row in rows),
    }
