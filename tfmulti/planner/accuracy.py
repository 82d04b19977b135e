"""How well predicted step times match measured ones: error, rank agreement, choice.

Pure Python. Three figures judge a planner over the layouts it ran:

- `mean_absolute_percentage_error`: the mean of |measured - predicted| / measured.
- `kendall_tau`: Kendall's tau-b between predicted and measured times (1: the same
  order, -1: reversed), through `scipy.stats.kendalltau` when SciPy is installed.
- `best_gap`: how much slower the predicted best measured than the fastest measured,
  as a fraction of the fastest (0: the planner's first choice was the fastest).

Beside them, `repeat_error` is the measurement's own noise: the MAPE each layout's counted
run scores against the layout's other runs, as if it were the prediction. No predictor can
be held to a MAPE below it. And `machine_drift` is how much slower the machine ran the
one-device anchor among the layouts than when the model was anchored on it (its fastest
run re-timed in the rounds, over the fastest when planning). A slow spell over the
planning runs raises every prediction alike, so `fastest_anchor_mape` is the MAPE with
the model anchored on the anchor's fastest run of all (planning's and the rounds', as a
layout's fastest run counts): the predictions times `machine_drift` where it is below 1,
unchanged otherwise. Kendall tau and the best gap do not depend on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """The three figures over the layouts that ran.

    Args:
        count: layouts measured.
        mape: mean absolute percentage error, as a fraction (0.1 = 10%).
        kendall_tau: rank correlation of predicted and measured times (None below 2).
        best_gap: measured time of the predicted best over the fastest measured, minus 1.
        repeat_error: `repeat_error` of the layouts' runs (None: no layout ran twice).
        machine_drift: the one-device step timed among the layouts over the one the model
            was anchored on (None: not re-timed).
        fastest_anchor_mape: the MAPE with the model anchored on the anchor's fastest run
            of all, planning's and the rounds'.
    """

    count: int
    mape: float
    kendall_tau: float | None
    best_gap: float
    repeat_error: float | None = None
    machine_drift: float | None = None
    fastest_anchor_mape: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """'MAPE 7.2%, Kendall tau 0.79, predicted best 1.3% slower than ...', and on a
        second line the anchor's drift since planning, when re-timed."""
        tau = "-" if self.kendall_tau is None else f"{self.kendall_tau:.2f}"
        noise = ""
        if self.repeat_error is not None:
            noise = f"; runs of one layout differ by {100 * self.repeat_error:.1f}% (MAPE)"
        drift = ""
        if self.machine_drift is not None:
            change = 100 * (self.machine_drift - 1)
            drift = (
                f"\nThe one-device step (the model's anchor) ran {abs(change):.1f}% "
                f"{'slower' if change >= 0 else 'faster'} among the layouts than when planned; "
                "anchored on its fastest run of all, the predictions score MAPE "
                f"{100 * self.fastest_anchor_mape:.1f}%"
            )
        return (
            f"{self.count} layouts: MAPE {100 * self.mape:.1f}%, Kendall tau {tau}, "
            f"predicted best {100 * self.best_gap:.1f}% slower than the fastest "
            f"measured{noise}{drift}"
        )


def _check_pairs(predicted: Sequence[float], measured: Sequence[float]) -> None:
    if len(predicted) != len(measured) or not predicted:
        raise ValueError(
            "Need one measured time per predicted time, at least one. Received: "
            f"predicted={list(predicted)}, measured={list(measured)}"
        )
    if min(measured) <= 0:
        raise ValueError(f"Measured times must be > 0. Received: measured={list(measured)}")


def mean_absolute_percentage_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean of |measured - predicted| / measured, as a fraction.

    Example:
        >>> mean_absolute_percentage_error([90, 110], [100, 100])
        0.1
    """
    _check_pairs(predicted, measured)
    return sum(abs(m - p) / m for p, m in zip(predicted, measured, strict=True)) / len(measured)


def kendall_tau(first: Sequence[float], second: Sequence[float]) -> float | None:
    """Kendall's tau-b of two equally long sequences; None when either is constant or short.

    Example:
        >>> round(kendall_tau([1, 2, 3], [10, 30, 20]), 4)
        0.3333
    """
    if len(first) != len(second):
        raise ValueError(
            f"Need sequences of equal length. Received: {len(first)} and {len(second)}"
        )
    if len(first) < 2:
        return None
    try:
        from scipy.stats import kendalltau
    except ImportError:
        return _kendall_tau_b(first, second)
    tau = kendalltau(first, second).statistic
    return None if math.isnan(tau) else float(tau)


def _kendall_tau_b(first: Sequence[float], second: Sequence[float]) -> float | None:
    """Tau-b by counting pairs: (concordant - discordant) / sqrt(untied in each)."""
    concordant = discordant = untied_first = untied_second = 0
    for i in range(len(first)):
        for j in range(i + 1, len(first)):
            sign = (first[i] - first[j]) * (second[i] - second[j])
            concordant += sign > 0
            discordant += sign < 0
            untied_first += first[i] != first[j]
            untied_second += second[i] != second[j]
    if not untied_first or not untied_second:
        return None
    return (concordant - discordant) / math.sqrt(untied_first * untied_second)


def best_gap(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """How much slower the layout predicted fastest measured than the fastest measured.

    Example:
        >>> round(best_gap([1.0, 2.0, 3.0], [110.0, 100.0, 120.0]), 4)
        0.1
    """
    _check_pairs(predicted, measured)
    chosen = min(range(len(predicted)), key=lambda index: predicted[index])
    return measured[chosen] / min(measured) - 1.0


def repeat_error(runs: Sequence[Sequence[float]]) -> float | None:
    """The MAPE each layout's fastest run (the one counted) scores against its other runs;
    `runs` holds each layout's run times. None when no layout ran twice.

    Example:
        >>> repeat_error([[100.0, 125.0], [50.0, 40.0], [70.0]])
        0.2
    """
    counted, others = [], []
    for times in runs:
        if min(times, default=1.0) <= 0:
            raise ValueError(f"Run times must be > 0. Received: {list(times)}")
        fastest = sorted(times)
        counted += fastest[:1] * (len(times) - 1)
        others += fastest[1:]
    if not others:
        return None
    return mean_absolute_percentage_error(counted, others)


def accuracy(
    predicted: Sequence[float],
    measured: Sequence[float],
    runs: Sequence[Sequence[float]] = (),
    machine_drift: float | None = None,
) -> Accuracy:
    """All three figures for layouts predicted at `predicted` that measured `measured`;
    with each layout's `runs`, their `repeat_error`; with the anchor's `machine_drift`
    since planning, the MAPE on its fastest run of all.

    Example:
        >>> figures = accuracy([10.0, 20.0], [8.0, 16.0], machine_drift=0.8)
        >>> round(figures.mape, 3), round(figures.fastest_anchor_mape, 3)
        (0.25, 0.0)
    """
    if machine_drift is not None and machine_drift <= 0:
        raise ValueError(f"machine_drift must be > 0. Received: {machine_drift}")
    on_fastest = None
    if machine_drift is not None:
        scale = min(machine_drift, 1.0)
        on_fastest = mean_absolute_percentage_error([time * scale for time in predicted], measured)
    return Accuracy(
        count=len(measured),
        mape=mean_absolute_percentage_error(predicted, measured),
        kendall_tau=kendall_tau(predicted, measured),
        best_gap=best_gap(predicted, measured),
        repeat_error=repeat_error(runs),
        machine_drift=machine_drift,
        fastest_anchor_mape=on_fastest,
    )
