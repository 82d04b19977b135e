"""A stand-in training process for launcher tests (no TensorFlow).

Records its pid (and a child's) in --pid_dir, prints its TF_CONFIG, then either
fails as told or finishes after a short pause. With --save_on_sigterm it acts as a
preempted training worker: on SIGTERM it notes so in --pid_dir and exits 42.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--pid_dir", required=True)
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--fail_with", choices=["exit3", "sigkill", "preempted"], default="exit3")
parser.add_argument("--fail_once_marker", default=None, help="fail only while this file is absent")
parser.add_argument("--ignore_sigterm", action="store_true")
parser.add_argument("--save_on_sigterm", action="store_true")
parser.add_argument("--run_seconds", type=float, default=0.5)
args = parser.parse_args()

rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def save_and_exit(signum, frame):
    open(os.path.join(args.pid_dir, f"sigterm-{rank}"), "w").close()
    child.kill()
    sys.exit(42)


if args.save_on_sigterm:
    signal.signal(signal.SIGTERM, save_and_exit)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(args.pid_dir, f"{rank}-{os.getpid()}"), "w") as file:
    file.write(f"{os.getpid()} {child.pid}")
print(f"tf_config task {rank} devices {os.environ.get('TFMULTI_VIRTUAL_DEVICES')}")
sys.stdout.write("step 1/2\rstep 2/2\n")
sys.stdout.flush()

should_fail = rank == args.fail_rank
if args.fail_once_marker is not None:
    should_fail = should_fail and not os.path.exists(args.fail_once_marker)
    if should_fail:
        open(args.fail_once_marker, "w").close()
if should_fail:
    time.sleep(0.3)
    if args.fail_with == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    child.kill()
    sys.exit(42 if args.fail_with == "preempted" else 3)
time.sleep(args.run_seconds)
child.kill()
child.wait()
print("done")
