"""The `scripts/train.py` flags that run a layout, and the command that starts it.

Pure Python. One device: `--strategy=one_device`; data only: `--strategy=mirrored`;
pipeline only: `--strategy=pipeline`; tensor only: `--strategy=model_parallel
--tensor_parallel=K`; two or more kinds at once: `--strategy=hybrid --mesh=...`. A
reference model's stages are cut by block index (`--partition=manual:3`), a user's
model by the calls where stages begin (`--partition=layers:hidden_2`).

Over several hosts the command is `scripts/launch.py --num_workers=H
--devices_per_worker=D -- python scripts/train.py ...` (the launcher gives each worker
its devices): data only runs `--strategy=multi_worker`, pipeline only `--strategy=pipeline`
over the workers' devices, and a mixed mesh `--strategy=hybrid --mesh=...
--cross_host_axis=data|pipe`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from tfmulti.planner.costs import ModelCosts
from tfmulti.planner.scoring import Layout, runs_pipeline_executor
from tfmulti.user_code import is_function_reference


def train_flags(layout: Layout, costs: ModelCosts, global_batch: int) -> list[str]:
    """The flags of `scripts/train.py` that train `costs.model` laid out as `layout`.

    Args:
        layout: a layout from `search_layouts`.
        costs: the model's costs (names the model, its options and the dataset).
        global_batch: examples per step over all replicas.

    Example:
        >>> train_flags(layout, costs, 64)[:3]
        ['--strategy=pipeline', '--virtual_devices=2', '--num_stages=2']
    """
    mesh = layout.mesh
    kinds = sum(size > 1 for size in (mesh.data, mesh.pipe, mesh.tensor))
    if layout.hosts > 1:
        flags = _cross_host_strategy_flags(layout, kinds)
    elif kinds == 0:
        flags = ["--strategy=one_device"]
    elif kinds > 1:
        flags = [
            "--strategy=hybrid",
            f"--virtual_devices={mesh.num_devices}",
            f"--mesh={mesh}",
        ]
    elif mesh.data > 1:
        flags = ["--strategy=mirrored", f"--virtual_devices={mesh.data}"]
    elif mesh.pipe > 1:
        flags = [
            "--strategy=pipeline",
            f"--virtual_devices={mesh.pipe}",
            f"--num_stages={mesh.pipe}",
        ]
    else:
        flags = [
            "--strategy=model_parallel",
            f"--virtual_devices={mesh.tensor}",
            f"--tensor_parallel={mesh.tensor}",
        ]
    if mesh.pipe > 1:
        flags += [
            f"--microbatches={layout.num_microbatches}",
            f"--schedule={layout.schedule}",
            *([f"--chunks={layout.chunks}"] if layout.chunks > 1 else []),
            _partition_flag(layout, costs),
        ]
    elif runs_pipeline_executor(mesh, layout.hosts):
        # Its replicas are one-stage pipelines of --microbatches (default 4): run the count
        # the layout was scored at.
        flags.append(f"--microbatches={layout.num_microbatches}")
    flags += [f"--model={costs.model}", f"--dataset={costs.dataset}"]
    if costs.data_path:
        flags.append(f"--data_path={costs.data_path}")
    flags += [f"--model_option={name}={value!r}" for name, value in costs.model_options.items()]
    flags.append(f"--batch_size={global_batch}")
    return flags


def _cross_host_strategy_flags(layout: Layout, kinds: int) -> list[str]:
    """The strategy of a layout over launched workers (the launcher sets their devices)."""
    mesh = layout.mesh
    if kinds == 1 and mesh.data > 1:
        return ["--strategy=multi_worker"]
    if kinds == 1 and mesh.pipe > 1:
        return ["--strategy=pipeline", f"--num_stages={mesh.pipe}"]
    return [
        "--strategy=hybrid",
        f"--mesh={mesh}",
        f"--cross_host_axis={layout.cross_host_axis}",
    ]


def launch_flags(layout: Layout) -> list[str]:
    """The `scripts/launch.py` flags that start `layout`'s workers, one per host, and its
    `launch_options`; none on one host.

    Example:
        >>> launch_flags(layout)  # data=2,pipe=2 over 2 hosts
        ['--num_workers=2', '--devices_per_worker=2']
    """
    if layout.hosts == 1:
        return []
    return [
        f"--num_workers={layout.hosts}",
        f"--devices_per_worker={layout.mesh.num_devices // layout.hosts}",
        *layout.launch_options,
    ]


def _partition_flag(layout: Layout, costs: ModelCosts) -> str:
    """A reference model is cut by block index; a user's model by the calls stages begin at."""
    if is_function_reference(costs.model):
        names = ",".join(costs.blocks[boundary].name for boundary in layout.boundaries)
        return f"--partition=layers:{names}"
    return f"--partition=manual:{','.join(str(b) for b in layout.boundaries)}"


def command_line(flags: Sequence[str], launch: Sequence[str] = ()) -> str:
    """`python scripts/train.py` with `flags`, quoted for a POSIX shell; with `launch`
    flags, started on workers by `python scripts/launch.py`."""
    train = ["python", "scripts/train.py", *flags]
    words = ["python", "scripts/launch.py", *launch, "--", *train] if launch else train
    return " ".join(shlex.quote(word) for word in words)
