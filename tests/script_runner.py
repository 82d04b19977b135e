"""Runs tfmulti's absl-flag scripts as users do: in a subprocess, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, *args: str, timeout: float = 300, env: dict | None = None):
    """Runs `python scripts/<script> args...`; returns the CompletedProcess (text mode)."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "scripts", script), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def last_line(text: str) -> str:
    """The last non-empty line of `text` (TensorFlow may log above it)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
