r"""`tfmulti-launch`: run a training command as a multi-worker cluster, here or over hosts.

Usage:
    tfmulti-launch --num_workers=2 --devices_per_worker=2 --max_restarts=1 --isolation=auto \
        -- python scripts/train.py --strategy=multi_worker --model_dir=/tmp/run
    tfmulti-launch --num_workers=2:3 --max_restarts_per_worker=1 --hosts_file=slots.txt \
        -- python scripts/train.py --strategy=multi_worker --batch_size=24 --model_dir=/tmp/run
    tfmulti-launch --num_workers=2:4 --max_restarts_per_worker=1 --slots_from=slurm \
        -- python scripts/train.py --strategy=multi_worker --batch_size=24 --model_dir=/tmp/run
    tfmulti-launch --num_workers=2 --hosts_file=hosts.txt --remote_shell="ssh -o BatchMode=yes" \
        -- /opt/venv/bin/python scripts/train.py --strategy=pipeline --num_stages=4 ...
"""

import functools
import sys

from absl import app, flags

from tfmulti.config import DistributionConfig
from tfmulti.flags.parsing import parse_flags_or_exit
from tfmulti.names import HYBRID_STRATEGY_NAME, STAGED_STRATEGY_NAMES
from tfmulti.platform.launching import launcher, membership, network_isolation
from tfmulti.platform.mesh import MeshError, parse_mesh, resolve_data_axis

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "num_workers",
    None,
    "Worker processes to start: N (>= 1), or MIN:MAX for an elastic job that starts MAX "
    "(or as many as the slot list holds) and goes on with as few as MIN.",
)
flags.DEFINE_integer(
    "max_restarts_per_worker",
    None,
    "Elastic jobs: a worker slot that fails more often than this is dropped and the group "
    "restarts on the others from the last step checkpoint (if at least MIN remain).",
    lower_bound=0,
)
flags.DEFINE_string(
    "hosts_file",
    None,
    "Elastic jobs: the worker slots, one a line, re-read while the job runs; a slot that "
    "leaves or joins restarts the group at the new size from a step checkpoint it saves.",
)
flags.DEFINE_string(
    "discovery_command",
    None,
    "Elastic jobs, instead of --hosts_file: a shell command that prints the worker slots, "
    "one a line, run again while the job runs (as Horovod's host-discovery script).",
)
flags.DEFINE_enum(
    "slots_from",
    None,
    launcher.SLOT_ORIGINS,
    "Elastic jobs, instead of --hosts_file: slurm: the worker slots are the tasks of this "
    "SLURM job's allocation (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE), read at the start; "
    "it must be this machine's (one node). Never implied: without it, a launch inside an "
    "allocation runs slot0 ... as anywhere else.",
)
flags.register_multi_flags_validator(
    ["hosts_file", "discovery_command"],
    lambda values: not (values["hosts_file"] and values["discovery_command"]),
    "--hosts_file and --discovery_command both give the slot list; keep one of them.",
)
flags.register_multi_flags_validator(
    ["slots_from", "hosts_file", "discovery_command"],
    lambda values: (
        not (values["slots_from"] and (values["hosts_file"] or values["discovery_command"]))
    ),
    "--slots_from gives the slot list, as --hosts_file and --discovery_command do; keep one.",
)
flags.DEFINE_string(
    "remote_shell",
    None,
    "Run each slot's worker on the slot's host (slots `host` or `host:index`, from "
    "--hosts_file, --discovery_command or --slots_from): this machine's here, other hosts' "
    "through this command, given the host and one shell line, e.g. 'ssh -o BatchMode=yes' "
    "or 'srun --nodes=1 --ntasks=1 --overlap -w {host} sh -c'. Workers start in this "
    "working directory there. Without it every worker runs here.",
)
flags.DEFINE_float(
    "rendezvous_timeout",
    60.0,
    "Elastic jobs with a slot list: seconds to wait for MIN slots before giving up.",
)
flags.DEFINE_integer(
    "devices_per_worker",
    None,
    "GPUs per worker when GPUs exist (CUDA_VISIBLE_DEVICES slices), else logical CPU "
    f"devices per worker (sets {launcher.VIRTUAL_DEVICES_ENV}).",
    lower_bound=1,
)
flags.DEFINE_integer(
    "max_restarts", 0, "Restarts of the whole group after a worker fails.", lower_bound=0
)
flags.DEFINE_float(
    "grace_seconds", 10.0, "Seconds between SIGTERM and SIGKILL when stopping workers."
)
flags.DEFINE_enum(
    "isolation",
    None,
    network_isolation.ISOLATIONS,
    "auto: the workers run in a private network holding only loopback where Linux allows "
    "it, else start with a one-line warning naming their open ports; namespace: refuse to "
    "start without that network; none: no private network (warns). Default: "
    f"${network_isolation.ISOLATION_VARIABLE}, else auto.",
)
flags.mark_flag_as_required("num_workers")


def _valid_worker_range(text: str | None) -> bool:
    try:
        membership.WorkerRange.parse(text or "1")
    except ValueError as error:
        raise flags.ValidationError(str(error)) from None
    return True


flags.register_validator("num_workers", _valid_worker_range)
flags.register_validator(
    "grace_seconds", lambda value: value > 0, message="--grace_seconds must be > 0, e.g. 10"
)


def _launch(argv: list[str]) -> None:
    command = argv[1:]
    if not command:
        sys.stderr.write(
            "launch: give the worker command after --, e.g. "
            "launch.py --num_workers=2 -- python scripts/train.py --strategy=multi_worker\n"
        )
        sys.exit(2)
    batch_size = _worker_flag(command, "batch_size") or ""
    strategy = _worker_flag(command, "strategy")
    hybrid = strategy == HYBRID_STRATEGY_NAME
    # A hybrid command without --mesh is refused by train.py itself.
    mesh = (_worker_flag(command, "mesh") or "") if hybrid else None
    # The training's own default, so the launcher counts the replicas it will train.
    cross_host_axis = _worker_flag(command, "cross_host_axis") or DistributionConfig.cross_host_axis
    workers = membership.WorkerRange.parse(FLAGS.num_workers)
    refusal = _pipe_across_workers_refusal(workers, mesh, cross_host_axis)
    if refusal:
        sys.stderr.write(f"launch: {refusal}\n")
        sys.exit(2)
    sys.exit(
        launcher.launch(
            command,
            num_workers=FLAGS.num_workers,
            devices_per_worker=FLAGS.devices_per_worker,
            max_restarts=FLAGS.max_restarts,
            grace_seconds=FLAGS.grace_seconds,
            isolation=FLAGS.isolation,
            max_restarts_per_worker=FLAGS.max_restarts_per_worker,
            hosts_file=FLAGS.hosts_file,
            discovery_command=FLAGS.discovery_command,
            global_batch_size=int(batch_size) if batch_size.isdigit() else None,
            rendezvous_timeout=FLAGS.rendezvous_timeout,
            slots_from=FLAGS.slots_from,
            mesh=mesh,
            cross_host_axis=cross_host_axis,
            remote_shell=FLAGS.remote_shell,
            one_replica=strategy in STAGED_STRATEGY_NAMES,
        )
    )


def _pipe_across_workers_refusal(
    workers: membership.WorkerRange, mesh: str | None, cross_host_axis: str
) -> str | None:
    """Why a hybrid mesh cannot lay its pipe axis over `workers`, as the training would
    refuse it after starting them; None when it can (or for other axes, strategies and
    malformed meshes, which the training refuses by itself).

    Each worker holds pipe / workers stages of every replica, so the worker count is tied
    to the pipe axis, while an elastic job resizes along the data axis only: with the pipe
    axis across the workers, a lost worker would take a share of every replica's stages.
    """
    if mesh is None or cross_host_axis != "pipe":
        return None
    if workers.minimum < workers.maximum:
        return (
            "an elastic job resizes a hybrid mesh along its data axis, so the data axis must "
            "cross the workers: add --cross_host_axis=data to the worker command. Received: "
            f"--num_workers={workers} with --cross_host_axis=pipe"
        )
    try:
        pipe = parse_mesh(resolve_data_axis(mesh, None)).pipe
    except MeshError:
        return None
    if pipe % workers.maximum:
        return (
            f"--cross_host_axis=pipe lays --mesh={mesh}'s pipe axis over {workers} workers, so "
            f"pipe must be a multiple of {workers}; use --cross_host_axis=data or another "
            f"mesh. Received: pipe={pipe}"
        )
    return None


def _worker_flag(command: list[str], name: str) -> str | None:
    """The value the worker command gives flag `name` (`--name=value` or `--name value`,
    as scripts/train.py takes it), so the launcher refuses worker counts whose data
    replicas do not split the global batch; the last one counts, as in absl."""
    found = None
    for index, argument in enumerate(command):
        flag, equals, value = argument.partition("=")
        if flag in (f"--{name}", f"-{name}"):
            found = value if equals else (command[index + 1 : index + 2] or [""])[0]
    return found


def main() -> None:
    """Launches the workers from the command line's flags (the `tfmulti-launch` command)."""
    parser = functools.partial(
        parse_flags_or_exit, usage=__doc__, module=__name__, title="launcher"
    )
    app.run(_launch, flags_parser=parser)
