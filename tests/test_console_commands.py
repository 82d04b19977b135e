"""`tfmulti-train`, `tfmulti-launch` and `tfmulti-plan` are installed and run the scripts' code."""

import importlib.metadata
import os
import subprocess
import sys

import pytest
from script_runner import last_line, run_script

COMMANDS = {
    "tfmulti-train": ("tfmulti.cli.train:main", "train.py", "--batch_size=0", "batch_size"),
    "tfmulti-launch": ("tfmulti.cli.launch:main", "launch.py", "--num_workers=0", "num_workers"),
    "tfmulti-plan": ("tfmulti.cli.plan:main", "plan.py", "--devices=0", "devices"),
}


def test_console_commands_point_at_the_cli_mains():
    installed = {
        entry.name: entry.value
        for entry in importlib.metadata.entry_points(group="console_scripts")
        if entry.name.startswith("tfmulti-")
    }
    assert installed == {name: target for name, (target, *_) in COMMANDS.items()}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_console_command_rejects_a_bad_flag_like_its_script(command, tmp_path):
    _, script, bad_flag, flag_name = COMMANDS[command]
    installed = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), command), bad_flag],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    from_checkout = run_script(script, bad_flag, timeout=120)

    assert installed.returncode == from_checkout.returncode == 2
    assert flag_name in last_line(installed.stderr)
    # The same message; only the program name in front differs.
    assert (
        last_line(installed.stderr).split(": ", 1)[1]
        == (last_line(from_checkout.stderr).split(": ", 1)[1])
    )
