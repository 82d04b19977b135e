"""A non-chief worker keeps Keras's progress and tfmulti's info lines to itself."""

import keras
import pytest
from absl import logging

from tfmulti.platform.runtime.cluster import resolve_cluster
from tfmulti.platform.runtime.worker_console import quiet_unless_chief

HOSTS = ["127.0.0.1:2222", "127.0.0.1:2223"]


@pytest.fixture
def console_state():
    """Restores Keras's interactive logging and the absl logger's own level after the test."""
    level = logging.get_absl_logger().level
    yield
    keras.config.enable_interactive_logging()
    logging.get_absl_logger().setLevel(level)


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
