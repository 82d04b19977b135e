"""The workers of a chief-driven run agree with the chief, and the chief hears their SIGTERM.

A serving worker's flags choose nothing (the chief drives its devices), so a worker
started with other flags or another cluster than the chief's is refused in one line
naming the difference, and the group ends. A SIGTERM to a serving worker alone makes the
chief save a step checkpoint and stop the group, which the launcher restarts from it.
"""

import signal
import subprocess
import sys

from script_runner import (
    assert_same_run,
    launch,
    read_metrics,
    start_launched_training,
)
from test_pipeline_across_workers import (
    FLAGS,
    PIPELINE,
    SIGNALLED,
    signal_once_checkpointed,
    signalled_one_device_dir,
)

from tfmulti.platform.runtime.cluster import resolve_cluster
from tfmulti.platform.runtime.cluster_agreement import (
    WorkerNotices,
    agreed_settings,
    disagreement_message,
)

# Runs its arguments as the command, with more flags for worker 1 alone (the last
# occurrence of a flag wins), so one worker of a launch disagrees.
WORKER_1_ALSO = """case "$TF_CONFIG" in *'"index": 1'*) set -- "$@" $WORKER_1_FLAGS;; esac
exec "$@"
"""


def start_with_worker_1_flags(worker_1_flags: str, launch_flags, train_args) -> subprocess.Popen:
    """Starts `scripts/launch.py launch_flags... -- python scripts/train.py train_args...`,
    worker 1 with `worker_1_flags` too; output and errors merged in `stdout`."""
    return launch(
        *launch_flags,
        "--",
        "sh",
        "-c",
        WORKER_1_ALSO.replace("$WORKER_1_FLAGS", worker_1_flags),
        "sh",
        sys.executable,
        "scripts/train.py",
        *train_args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_a_worker_started_with_other_flags_is_refused_in_one_line_and_the_group_ends(tmp_path):
    model_dir = tmp_path / "run"
    launcher = start_with_worker_1_flags(
        # Only --num_stages counts: where a worker keeps its files and how long it waits
        # may differ.
        f"--num_stages=2 --model_dir={tmp_path / 'elsewhere'} --connect_timeout=99",
        ("--num_workers=2", "--devices_per_worker=2"),
        (*FLAGS, *PIPELINE, f"--model_dir={model_dir}"),
    )
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, output[-3000:]
    assert (
        "train.py: error: Worker 1 disagrees with the chief on --num_stages (chief 4, worker 2); "
        "start every worker with the same flags."
    ) in output
    assert "Traceback" not in output
    assert not (model_dir / "metrics.json").exists()


def test_a_disagreement_names_every_setting_the_worker_holds_otherwise():
    chief = {"--num_stages": "4", "--schedule": "1f1b", "--batch_size": "32"}
    worker = {"--num_stages": "2", "--schedule": "gpipe", "--batch_size": "32"}
    assert disagreement_message(3, chief, worker) == (
        "Worker 3 disagrees with the chief on --num_stages (chief 4, worker 2) and --schedule "
        "(chief 1f1b, worker gpipe); start every worker with the same flags."
    )
    assert disagreement_message(1, chief, dict(chief)) == ""


def test_a_worker_that_sees_another_cluster_or_flag_set_is_named_with_it():
    chief = agreed_settings(resolve_cluster(["h:1", "h:2"], task_index=0), {})
    worker = agreed_settings(resolve_cluster(["h:1", "h:3"], task_index=1), {"--remat": "True"})
    assert disagreement_message(1, chief, worker) == (
        "Worker 1 disagrees with the chief on the cluster (chief h:1,h:2, worker h:1,h:3) and "
        "--remat (chief not given, worker True); start every worker with the same flags."
    )


def test_a_workers_notices_are_read_on_its_own_device(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    notices = WorkerNotices("[::1]:2222")
    assert notices.read_settings("/device:CPU:1") is None
    notices.post_settings({"--num_stages": "4"})
    assert notices.read_settings("/device:CPU:1") == {"--num_stages": "4"}
    assert not notices.got_sigterm("/device:CPU:1")
    notices.post_sigterm()
    assert notices.got_sigterm("/device:CPU:1")
    notices.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_to_a_serving_worker_alone_saves_and_the_group_ends_like_the_uninterrupted_run(
    tmp_path, shared_dir
):
    model_dir = str(tmp_path / "run")
    launcher = start_launched_training(
        ("--num_workers=2", "--devices_per_worker=2", "--max_restarts=1", "--grace_seconds=30"),
        # Two stages, one a worker (the last flag counts): worker 1 serves stage 1.
        (
            *SIGNALLED,
            *PIPELINE,
            "--num_stages=2",
            "--microbatches=2",
            "--schedule=1f1b",
            f"--model_dir={model_dir}",
        ),
    )
    try:
        signal_once_checkpointed(launcher, model_dir, (1,), 3, signal.SIGTERM)
        output, _ = launcher.communicate(timeout=150)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "Worker 1 got SIGTERM: saving a step checkpoint to stop at." in output
    assert "worker 0 was preempted and saved a checkpoint (code 42)" in output
    (resume,) = read_metrics(model_dir)["resumes"]
    # Saved after the SIGTERM (global step 3), not before: 12 steps an epoch.
    assert (resume["epoch"] - 1) * 12 + resume["step"] > 3
    assert_same_run(model_dir, signalled_one_device_dir(shared_dir))


def test_the_chief_looks_for_a_serving_workers_sigterm_every_few_steps_of_a_fast_run(
    monkeypatch,
):
    from tfmulti.platform.runtime import connected_cluster

    class Notices:
        looks = 0
        posted = False

        def got_sigterm(self, device):
            Notices.looks += 1
            return Notices.posted

    monkeypatch.setattr(connected_cluster, "_serving_workers", [(1, "/cpu:0", Notices())])
    monkeypatch.setattr(connected_cluster, "_next_sigterm_check", 0.0)
    monkeypatch.setattr(connected_cluster, "_steps_since_sigterm_check", 0)
    # The clock stands still: every step falls within the same second.
    monkeypatch.setattr(connected_cluster.time, "monotonic", lambda: 100.0)
    # Steps far faster than the once-a-second look: the first step looks, then every
    # _SIGTERM_CHECK_STEPS-th, so a notice posted mid-run is seen before a short run ends.
    steps = 1 + 2 * connected_cluster._SIGTERM_CHECK_STEPS
    assert [connected_cluster.serving_worker_got_sigterm() for _ in range(steps)] == [None] * steps
    assert Notices.looks == 3
    Notices.posted = True
    seen = [connected_cluster.serving_worker_got_sigterm() for _ in range(steps)]
    assert seen.index(1) == connected_cluster._SIGTERM_CHECK_STEPS - 1
