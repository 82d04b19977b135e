r"""`tfmulti-train`: train a reference model or your own, spread over devices.

Examples:
    tfmulti-train --strategy=mirrored --virtual_devices=4 --model=convnet \
        --dataset=digits --batch_size=128 --epochs=5 --model_dir=runs/digits
    tfmulti-train --strategy=model_parallel --model=my_project.models:small_cnn \
        --model_option=width=64 --dataset=my_project.data:load --model_dir=runs/mine
    tfmulti-train --strategy=pipeline --model=convnet --optimizer=sgd --learning_rate=0.1 \
        --lr_schedule=cosine --warmup_steps=50 --callbacks=my_project.hooks:callbacks
"""

import os

from absl import flags, logging

from tfmulti.flags.console_flags import define_console_flags, define_worker_console_flags
from tfmulti.flags.parsing import run_script
from tfmulti.flags.training_flags import config_from_flags, define_train_flags

FLAGS = flags.FLAGS
define_train_flags()
define_console_flags()
define_worker_console_flags()


def _train(argv: list[str]) -> None:
    del argv
    from tfmulti.platform.runtime.tf_startup import start_tensorflow

    # Before anything imports TensorFlow, so its start-up notices stay off the console.
    start_tensorflow(FLAGS.tf_log_level)
    if FLAGS.virtual_devices:
        from tfmulti.platform.runtime.devices import configure_logical_devices

        configure_logical_devices(FLAGS.virtual_devices)
    from tfmulti.collectives.collective_all_reduce import set_collective_timeout
    from tfmulti.collectives.tensor_reduction import set_tensor_reduction
    from tfmulti.platform.runtime.worker_console import quiet_unless_chief
    from tfmulti.run.training import NOTHING_LEFT_TO_TRAIN, SERVED_CHIEF
    from tfmulti.strategies import get_training_strategy

    set_tensor_reduction(FLAGS.tensor_reduce)
    set_collective_timeout(FLAGS.collective_timeout)
    config = config_from_flags()
    training_strategy = get_training_strategy(
        config.distribution.strategy, config.distribution.zero
    )
    cluster = training_strategy.resolve_cluster(config)
    quiet = quiet_unless_chief(cluster, FLAGS.verbose_workers)
    record = _train_or_report_timeout(config)
    if quiet or record.get(NOTHING_LEFT_TO_TRAIN) or record.get(SERVED_CHIEF):
        return
    final = ", ".join(f"{name}={value:.4f}" for name, value in record["final"].items())
    logging.info("Final validation: %s", final)
    print(f"TensorBoard logs: {os.path.join(FLAGS.model_dir, 'logs')}")
    print(f"Metrics: {os.path.join(FLAGS.model_dir, 'metrics.json')}")


def _train_or_report_timeout(config):
    """`train(config)`; a collective that timed out, or a worker that went away, becomes one
    line."""
    import tensorflow as tf

    from tfmulti.errors import TrainingError
    from tfmulti.run.training import train

    try:
        return train(config)
    except tf.errors.UnavailableError as error:
        from tfmulti.platform.runtime.connected_cluster import lost_worker_message

        raise TrainingError(lost_worker_message(str(error))) from None
    except tf.errors.DeadlineExceededError:
        waited = f"{FLAGS.collective_timeout:g} s" if FLAGS.collective_timeout else "its timeout"
        raise TrainingError(
            f"A collective waited {waited} for a device or worker of its group that did not "
            "arrive (--collective_timeout); check the other workers' logs, or raise "
            "--collective_timeout."
        ) from None


def main() -> None:
    """Runs training from the command line's flags (the `tfmulti-train` command)."""
    from tfmulti.errors import USER_ERRORS

    run_script(_train, USER_ERRORS, usage=__doc__, module=__name__)
