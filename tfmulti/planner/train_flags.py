"""The `scripts/train.py` flags that run a layout, and the command that starts it.

Pure Python. The strategy is `tfmulti.planner.train_strategy`'s choice, with the flags
it needs (`--num_stages`, `--tensor_parallel=K`, `--mesh=...`). A
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
from tfmulti.planner.scoring import Layout
from tfmulti.planner.train_strategy import EXECUTOR_STRATEGIES, train_strategy
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
    strategy = train_strategy(mesh, layout.hosts)
    flags = [f"--strategy={strategy}"]
    if layout.hosts == 1 and strategy != "one_device":
        flags.append(f"--virtual_devices={mesh.num_devices}")
    if strategy == "hybrid":
        flags.append(f"--mesh={mesh}")
        if layout.hosts > 1:
            flags.append(f"--cross_host_axis={layout.cross_host_axis}")
    elif strategy == "pipeline":
        flags.append(f"--num_stages={mesh.pipe}")
    elif strategy == "model_parallel":
        flags.append(f"--tensor_parallel={mesh.tensor}")
    if layout.zero:
        flags.append(f"--zero={layout.zero}")
    if mesh.pipe > 1:
        flags += [
            f"--microbatches={layout.num_microbatches}",
            f"--schedule={layout.schedule}",
            *([f"--chunks={layout.chunks}"] if layout.chunks > 1 else []),
            _partition_flag(layout, costs),
        ]
    elif strategy in EXECUTOR_STRATEGIES:
        # Its replicas are one-stage pipelines of --microbatches (default 4): run the count
        # the layout was scored at.
        flags.append(f"--microbatches={layout.num_microbatches}")
    flags += [f"--model={costs.model}", f"--dataset={costs.dataset}"]
    if costs.data_path:
        flags.append(f"--data_path={costs.data_path}")
    flags += [f"--model_option={name}={value!r}" for name, value in costs.model_options.items()]
    flags.append(f"--batch_size={global_batch}")
    return flags


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
