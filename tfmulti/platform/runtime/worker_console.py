"""Quiet non-chief workers: one worker's progress lines are enough for a cluster's log.

Under the launcher, SLURM or a plain `TF_CONFIG`, every worker runs the same `fit`, so
each would print the same Keras progress lines and final paths. A quiet worker sends
Keras's progress through absl logging (as Keras does for non-interactive runs) and shows
only absl warnings and errors, so what a worker prints is what went wrong.
"""

from __future__ import annotations

from absl import logging

from tfmulti.platform.runtime.cluster import ClusterInfo


def quiet_unless_chief(cluster: ClusterInfo | None, verbose_workers: bool = False) -> bool:
    """Quiets this process if it is a non-chief worker; returns whether it did.

    Args:
        cluster: the run's cluster; None for a run on one host (never quieted).
        verbose_workers: keep every worker's lines (`--verbose_workers`).
    """
    if verbose_workers or cluster is None or cluster.is_chief:
        return False
    import keras

    keras.config.disable_interactive_logging()
    logging.set_verbosity(logging.WARNING)
    return True
