"""Learning-rate schedules of the built-in optimizers: warm-up, then constant, cosine or linear.

As Model Garden's `optimization` package offers them: the rate climbs linearly from 0 to
`--learning_rate` over `--warmup_steps`, then stays (`constant`) or decays to 0 by the
run's last step (`cosine`, `linear`).
"""

from __future__ import annotations

import keras

from tfmulti.config import LR_SCHEDULE_NAMES


@keras.saving.register_keras_serializable(package="tfmulti")
class LinearWarmUp(keras.optimizers.schedules.LearningRateSchedule):
    """A rate that climbs linearly from 0 to `after_warmup(0)`, then follows `after_warmup`.

    Args:
        after_warmup: the rate after the warm-up: a float, or a schedule started at 0 when
            the warm-up ends.
        warmup_steps: steps of the climb (at least 1).

    Example:
        >>> rate = LinearWarmUp(keras.optimizers.schedules.PolynomialDecay(0.1, 90), 10)
        >>> float(rate(5))  # half-way up
        0.05
    """

    def __init__(self, after_warmup, warmup_steps: int, name: str = "LinearWarmUp"):
        super().__init__()
        if isinstance(after_warmup, dict):
            after_warmup = keras.optimizers.schedules.deserialize(after_warmup)
        self.after_warmup = after_warmup
        self.warmup_steps = warmup_steps
        self.name = name

    def _rate_after_warmup(self, step):
        if isinstance(self.after_warmup, keras.optimizers.schedules.LearningRateSchedule):
            return self.after_warmup(step)
        return keras.ops.convert_to_tensor(self.after_warmup, "float32")

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup_steps = keras.ops.cast(self.warmup_steps, "float32")
        target = self._rate_after_warmup(keras.ops.zeros((), "float32"))
        return keras.ops.where(
            step < warmup_steps,
            target * step / warmup_steps,
            self._rate_after_warmup(keras.ops.maximum(step - warmup_steps, 0.0)),
        )

    def get_config(self) -> dict:
        after_warmup = self.after_warmup
        if isinstance(after_warmup, keras.optimizers.schedules.LearningRateSchedule):
            after_warmup = keras.optimizers.schedules.serialize(after_warmup)
        return {"after_warmup": after_warmup, "warmup_steps": self.warmup_steps, "name": self.name}


def learning_rate_schedule(name: str, learning_rate: float, warmup_steps: int, total_steps: int):
    """The learning rate of `--lr_schedule=name`: a float when it never changes, else a schedule.

    Args:
        name: "constant", "cosine" or "linear" (the shape after the warm-up).
        learning_rate: the peak rate, reached when the warm-up ends.
        warmup_steps: steps of the linear climb from 0 (0: none).
        total_steps: steps of the whole run; cosine and linear reach 0 at its end.

    Raises:
        ValueError: an unknown name, or a warm-up that leaves no step after it; one line.

    Example:
        >>> rate = learning_rate_schedule("cosine", 0.1, warmup_steps=10, total_steps=100)
        >>> float(rate(10)), float(rate(55)), float(rate(100))
        (0.1, 0.05, 0.0)
    """
    if name not in LR_SCHEDULE_NAMES:
        raise ValueError(
            f"--lr_schedule must be one of {list(LR_SCHEDULE_NAMES)}. Received: {name}"
        )
    if warmup_steps and warmup_steps >= total_steps:
        raise ValueError(
            f"--warmup_steps={warmup_steps} leaves no step after the warm-up: the run trains "
            f"{total_steps} steps (--epochs x --steps_per_epoch); use fewer warm-up steps."
        )
    decay_steps = total_steps - warmup_steps
    if name == "cosine":
        if not warmup_steps:
            return keras.optimizers.schedules.CosineDecay(learning_rate, decay_steps)
        return keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps, warmup_target=learning_rate, warmup_steps=warmup_steps
        )
    after_warmup = learning_rate
    if name == "linear":
        after_warmup = keras.optimizers.schedules.PolynomialDecay(
            learning_rate, decay_steps, end_learning_rate=0.0, power=1.0
        )
    return LinearWarmUp(after_warmup, warmup_steps) if warmup_steps else after_warmup


def describe_learning_rate(learning_rate) -> str:
    """A short text of an optimizer's learning rate (a number or a schedule), for logs.

    Example:
        >>> describe_learning_rate(LinearWarmUp(0.1, warmup_steps=10))
        'LinearWarmUp(after_warmup=0.1, warmup_steps=10)'
    """
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        settings = [
            f"{key}={_describe_setting(value)}"
            for key, value in learning_rate.get_config().items()
            if key != "name"
        ]
        return f"{type(learning_rate).__name__}({', '.join(settings)})"
    return f"{float(keras.ops.convert_to_numpy(learning_rate)):g}"


def _describe_setting(value) -> str:
    if isinstance(value, dict):  # a nested schedule, as `get_config` serializes it
        return describe_learning_rate(keras.optimizers.schedules.deserialize(value))
    return str(value)
