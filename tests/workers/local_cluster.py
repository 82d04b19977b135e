"""Runs a worker script as a local cluster for tests: one process group per worker, bounded time."""

import os
import signal
import subprocess
import sys

from tfmulti.platform.launching.launcher import worker_environments

WORKERS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(WORKERS_DIR))


def run_local_cluster(script, args, num_workers=2, timeout_seconds=120):
    """Runs tests/workers/<script> on `num_workers` workers; returns [(returncode, output)]."""
    environments = worker_environments(num_workers)
    processes = []
    for environment in environments:
        environment["TF_CPP_MIN_LOG_LEVEL"] = "2"
        environment["PYTHONPATH"] = REPO_ROOT
        # A native crash (SIGSEGV, SIGABRT) prints every thread's Python stack.
        environment["PYTHONFAULTHANDLER"] = "1"
        processes.append(
            subprocess.Popen(
                [sys.executable, os.path.join(WORKERS_DIR, script), *args],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
            )
        )
    results = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=timeout_seconds)
            results.append((process.returncode, output))
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    return results


def assert_all_workers_succeeded(results) -> None:
    """Fails with the output tail of every worker that exited non-zero."""
    failures = [
        f"worker {rank} exited with {returncode}:\n{output[-2500:]}"
        for rank, (returncode, output) in enumerate(results)
        if returncode != 0
    ]
    assert not failures, "\n\n".join(failures)
