"""Ray Train as a way to launch tfmulti: one Ray worker per tfmulti worker.

Example:
    >>> from tfmulti.config import TrainConfig
    >>> from tfmulti.ray import trainer
    >>> config = TrainConfig.from_flat(strategy="multi_worker", model="mlp",
    ...                                dataset="synthetic", model_dir="/shared/runs/mlp")
    >>> result = trainer(config, num_workers=2).fit()
    >>> result.metrics["loss"]
"""

try:
    import ray.train  # noqa: F401
except ImportError as error:
    raise ImportError(
        f"tfmulti.ray needs Ray Train ({error}); install it with: pip install 'tfmulti[ray]'"
    ) from None

from tfmulti.ray.reporting import ReportToRay
from tfmulti.ray.trainer import train_loop, trainer

__all__ = ["ReportToRay", "train_loop", "trainer"]
