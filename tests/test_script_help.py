"""`--help` of every script lists the script's own flags, by group, and nothing of absl's
or TensorFlow's; its examples print as runnable commands."""

import glob
import os
import re
import subprocess
import sys

import pytest
from script_runner import REPO_ROOT, run_script

SCRIPTS = sorted(os.path.basename(path) for path in glob.glob(f"{REPO_ROOT}/scripts/*.py"))
CONSOLE_COMMANDS = {
    "tfmulti-train": "train.py",
    "tfmulti-launch": "launch.py",
    "tfmulti-plan": "plan.py",
}
LISTED_FLAG = re.compile(r"^\s+(?:-\?,)?--(?:\[no\])?(\w+):", re.MULTILINE)
FOREIGN = ("absl", "tensorflow")
HEADING = re.compile(r"^(\S[^\n]*):$", re.MULTILINE)


def _flags_by_heading(help_text: str) -> dict[str, set[str]]:
    """{section heading: flag names listed under it} of absl-style help text."""
    sections = {}
    headings = list(HEADING.finditer(help_text))
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        end = following.start() if following else len(help_text)
        sections[heading.group(1)] = set(LISTED_FLAG.findall(help_text, heading.end(), end))
    return sections


def _foreign_flags_of_this_process() -> set[str]:
    """Flags that absl and TensorFlow define (this test process imported both)."""
    import tensorflow  # noqa: F401
    from absl import app, flags

    app.define_help_flags()
    return {
        flag.name
        for module, module_flags in flags.FLAGS.flags_by_module_dict().items()
        if module.startswith(FOREIGN)
        for flag in module_flags
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_the_scripts_own_flags_and_none_of_absls_or_tensorflows(script):
    full = run_script(script, "--helpfull", timeout=120)
    short = run_script(script, "--help", timeout=120)

    assert short.returncode == 0, short.stderr[-2000:]
    everything = _flags_by_heading(full.stdout)
    own = set().union(
        *(names for heading, names in everything.items() if not heading.startswith(FOREIGN))
    )
    foreign = _foreign_flags_of_this_process().union(
        *(names for heading, names in everything.items() if heading.startswith(FOREIGN))
    )
    listed = set(LISTED_FLAG.findall(short.stdout))
    assert own, f"--helpfull of {script} lists no flag of the script: {full.stdout[:2000]}"
    assert own - {"help", "helpshort"} <= listed
    assert not listed & foreign, f"--help of {script} lists {sorted(listed & foreign)}"


def test_train_help_lists_flags_under_their_groups_with_defaults():
    result = run_script("train.py", "--help", timeout=60)

    sections = _flags_by_heading(result.stdout)
    assert {"strategy", "virtual_devices"} <= sections["devices"]
    assert {"mesh", "schedule", "microbatches"} <= sections[
        "pipeline, model, tensor and hybrid parallelism"
    ]
    assert {"batch_size", "epochs"} <= sections["training loop"]
    assert "--batch_size: GLOBAL batch size, split evenly over replicas.\n    (default: '64')" in (
        result.stdout
    )


@pytest.mark.parametrize("script", ["train.py", "launch.py"])
def test_help_examples_print_as_runnable_commands(script):
    result = run_script(script, "--help", timeout=60)

    lines = result.stdout.splitlines()
    # A swallowed line continuation shows as text, a run of spaces, then the next flag.
    assert not [line for line in lines if re.search(r"\S {3,}--", line)]
    continued = [index for index, line in enumerate(lines) if line.endswith(" \\")]
    assert continued, f"no multi-line example in --help of {script}"
    assert all(lines[index + 1].lstrip().startswith("--") for index in continued)


@pytest.mark.parametrize("command", sorted(CONSOLE_COMMANDS))
def test_console_command_help_equals_its_scripts(command, tmp_path):
    installed = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), command), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    from_checkout = run_script(CONSOLE_COMMANDS[command], "--help", timeout=60)

    assert installed.returncode == from_checkout.returncode == 0
    assert installed.stdout == from_checkout.stdout
