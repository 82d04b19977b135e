r"""`tfmulti-launch`: run a training command as a local multi-worker cluster.

Usage:
    tfmulti-launch --num_workers=2 [--devices_per_worker=2] [--max_restarts=1] \
        [--isolation=auto|namespace|none] \
        -- python scripts/train.py --strategy=multi_worker --model_dir=/tmp/run
"""

import functools
import sys

from absl import app, flags

from tfmulti.flags.parsing import parse_flags_or_exit
from tfmulti.platform import launcher, network_isolation

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", None, "Worker processes to start (>= 1).", lower_bound=1)
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
    sys.exit(
        launcher.launch(
            command,
            num_workers=FLAGS.num_workers,
            devices_per_worker=FLAGS.devices_per_worker,
            max_restarts=FLAGS.max_restarts,
            grace_seconds=FLAGS.grace_seconds,
            isolation=FLAGS.isolation,
        )
    )


def main() -> None:
    """Launches the workers from the command line's flags (the `tfmulti-launch` command)."""
    parser = functools.partial(
        parse_flags_or_exit, usage=__doc__, module=__name__, title="launcher"
    )
    app.run(_launch, flags_parser=parser)
