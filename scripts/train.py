"""Train a reference model with tfmulti.

Example:
    python scripts/train.py --strategy=mirrored --virtual_devices=4 --model=convnet \
        --dataset=digits --batch_size=128 --epochs=5 --model_dir=runs/digits
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags, logging  # noqa: E402

from tfmulti.flags.parsing import run_script  # noqa: E402
from tfmulti.flags.training_flags import config_from_flags, define_train_flags  # noqa: E402

FLAGS = flags.FLAGS
define_train_flags()


def main(argv):
    del argv
    if FLAGS.virtual_devices:
        from tfmulti.devices import configure_logical_devices

        configure_logical_devices(FLAGS.virtual_devices)
    from tfmulti.training import train

    record = train(config_from_flags())
    final = ", ".join(f"{name}={value:.4f}" for name, value in record["final"].items())
    logging.info("Final validation: %s", final)
    print(f"TensorBoard logs: {os.path.join(FLAGS.model_dir, 'logs')}")
    print(f"Metrics: {os.path.join(FLAGS.model_dir, 'metrics.json')}")


if __name__ == "__main__":
    from tfmulti.errors import USER_ERRORS

    run_script(main, USER_ERRORS)
