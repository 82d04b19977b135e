"""A non-chief worker keeps Keras's progress and tfmulti's info lines to itself."""

import logging as std_logging

import keras
import pytest
from absl import logging

from tfmulti.platform.runtime.cluster import resolve_cluster
from tfmulti.platform.runtime.worker_console import quiet_unless_chief

HOSTS = ["127.0.0.1:2222", "127.0.0.1:2223"]


@pytest.fixture
def console_state():
    """Restores Keras's interactive logging, absl's verbosity and the absl and root loggers'
    own levels after the test."""
    root = std_logging.getLogger()
    verbosity, levels = logging.get_verbosity(), (logging.get_absl_logger().level, root.level)
    yield
    keras.config.enable_interactive_logging()
    logging.set_verbosity(verbosity)
    logging.get_absl_logger().setLevel(levels[0])
    root.setLevel(levels[1])


def test_a_non_chief_worker_prints_only_warnings_and_errors(console_state):
    logging.set_verbosity(logging.INFO)

    assert quiet_unless_chief(resolve_cluster(HOSTS, task_index=1))
    assert not keras.config.is_interactive_logging_enabled()
    assert logging.get_verbosity() == logging.WARNING


@pytest.mark.parametrize(
    "cluster, verbose_workers",
    [
        (None, False),
        (resolve_cluster(HOSTS, task_index=0), False),
        (resolve_cluster(HOSTS, task_index=1), True),
    ],
    ids=["one_host", "chief", "verbose_workers"],
)
def test_the_chief_a_single_host_and_verbose_workers_keep_every_line(
    console_state, cluster, verbose_workers
):
    logging.set_verbosity(logging.INFO)

    assert not quiet_unless_chief(cluster, verbose_workers)
    assert keras.config.is_interactive_logging_enabled()
    assert logging.get_verbosity() == logging.INFO


QUIETED_SCRIPT = """
from absl import app, logging
from tfmulti.platform.runtime.quiet_logs import warnings_only

def main(argv):
    with warnings_only():
        logging.info("hidden")
    logging.info("shown after")

app.run(main)
"""


def test_info_lines_come_back_after_a_quiet_spell_in_a_script_and_under_caplog(caplog):
    """Under `absl.app` absl's handler sets the root logger's level, elsewhere its own
    logger's: both are as before the quiet spell (the chief of a chief-driven run logs its
    stage table after connecting to the workers inside one)."""
    import os
    import subprocess
    import sys

    from tfmulti.platform.runtime.quiet_logs import warnings_only

    result = subprocess.run(
        [sys.executable, "-c", QUIETED_SCRIPT],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "shown after" in result.stderr and "hidden" not in result.stderr

    with caplog.at_level(std_logging.INFO):
        with warnings_only():
            logging.info("hidden")
        logging.info("shown after")
    assert "shown after" in caplog.text and "hidden" not in caplog.text
