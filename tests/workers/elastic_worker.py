"""A stand-in training worker for elastic launcher tests (no TensorFlow).

Writes `<attempt>-<slot>` into --run_dir with its group's size and prints its slot. When
its slot is in --fail_slots it fails (exit 3) once every worker of its attempt has
started, else it runs until --stop_file exists. On SIGTERM it acts as a preempted worker
that saved a checkpoint: exit 42.
"""

import argparse
import json
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--run_dir", required=True)
parser.add_argument("--fail_slots", default="")
parser.add_argument("--stop_file", default=None)
parser.add_argument("--batch_size", type=int, default=None)
args = parser.parse_args()

slot = os.environ["TFMULTI_SLOT"]
attempt = os.environ["TFMULTI_RESTART_COUNT"]
num_workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(42))
with open(os.path.join(args.run_dir, f"{attempt}-{slot}"), "w") as handle:
    handle.write(f"{num_workers} {os.environ['TFMULTI_MEMBERSHIP']}")
print(f"slot {slot} of {num_workers}", flush=True)
if slot in args.fail_slots.split(","):
    # Fail only once every worker of this attempt has started (written its file), so the
    # test sees the whole group however slowly the processes start under load.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        started = [name for name in os.listdir(args.run_dir) if name.startswith(f"{attempt}-")]
        if len(started) >= num_workers:
            break
        time.sleep(0.02)
    sys.exit(3)
while args.stop_file and not os.path.exists(args.stop_file):
    time.sleep(0.05)
print("done")
