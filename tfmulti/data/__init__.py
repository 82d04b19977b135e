"""Datasets for tfmulti: named sources, their DataInfo, and global-batch tf.data pipelines.

Example:
    >>> from tfmulti.data import make_datasets
    >>> data = make_datasets("digits", global_batch_size=64, seed=0)
    >>> data.info.input_shape, data.steps_per_epoch
    ((8, 8, 1), 22)
"""

from tfmulti.data.digits import load_digits
from tfmulti.data.info import (
    CLASSIFICATION,
    LANGUAGE_MODEL,
    TASKS,
    ArrayData,
    DataInfo,
)
from tfmulti.data.npz import load_npz
from tfmulti.data.pipeline import (
    TrainingData,
    array_training_stream,
    make_datasets,
    make_datasets_from_source,
    stream_training_batches,
)
from tfmulti.data.sources import (
    DATASET_NAMES,
    check_dataset_name,
    dataset_task,
    first_training_examples,
    load_source,
)
from tfmulti.data.synthetic import (
    TOKEN_RULE_PROBABILITY,
    synthetic_classification,
    synthetic_tokens,
)
from tfmulti.data.tfrecord import RecordData, load_tfrecord, write_tfrecord_examples
from tfmulti.data.user import StreamData, load_user_dataset

__all__ = [
    "CLASSIFICATION",
    "DATASET_NAMES",
    "LANGUAGE_MODEL",
    "TASKS",
    "TOKEN_RULE_PROBABILITY",
    "ArrayData",
    "DataInfo",
    "RecordData",
    "StreamData",
    "TrainingData",
    "array_training_stream",
    "check_dataset_name",
    "dataset_task",
    "first_training_examples",
    "load_digits",
    "load_npz",
    "load_source",
    "load_tfrecord",
    "load_user_dataset",
    "make_datasets",
    "make_datasets_from_source",
    "stream_training_batches",
    "synthetic_classification",
    "synthetic_tokens",
    "write_tfrecord_examples",
]
