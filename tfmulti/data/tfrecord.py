"""User datasets stored as TFRecord files of tf.train.Example records.

Each record is one classification example with three features:
    `x`: float_list, the example's values flattened in C order;
    `shape`: int64_list, the example's shape, e.g. [8, 8, 1];
    `y`: int64_list of length 1, the example's label.
All records must share one shape. `write_tfrecord_examples` writes this format.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfmulti.data.info import CLASSIFICATION, DataInfo, check_arrays

_INSPECTION_BATCH = 4096


@dataclasses.dataclass(frozen=True)
class RecordData:
    """A TFRecord dataset read lazily: unbatched (x, y) streams plus their DataInfo.

    Args:
        files: the record files, in sorted order.
        train: (x, y) pairs of the training split, in file order.
        validation: (x, y) pairs of the validation split, in file order.
        info: shapes and sizes found by reading the files once.
    """

    files: tuple[str, ...]
    train: tf.data.Dataset
    validation: tf.data.Dataset
    info: DataInfo


def write_tfrecord_examples(path: str, x: np.ndarray, y: np.ndarray) -> None:
    """Writes one tf.train.Example per example of x and its integer label y.

    Args:
        path: the file to write (overwritten).
        x: examples; the first axis is the example axis.
        y: integer labels, shape (len(x),).

    Example:
        >>> write_tfrecord_examples("train.tfrecord", np.zeros((4, 2, 2)), np.arange(4))
    """
    x, y = np.asarray(x), np.asarray(y)
    check_arrays(x, y, where=path)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(
            f"y must be integer labels of shape (n,). Received: y.shape={y.shape}, "
            f"y.dtype={y.dtype}"
        )
    shape = tf.train.Feature(int64_list=tf.train.Int64List(value=list(x.shape[1:])))
    with tf.io.TFRecordWriter(path) as writer:
        for example_x, label in zip(x.astype(np.float32), y, strict=True):
            features = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=example_x.ravel())),
                "shape": shape,
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())


def load_tfrecord(
    pattern: str, num_classes: int | None = None, validation_fraction: float = 0.2
) -> RecordData:
    """Opens TFRecord files and splits their records into training and validation.

    Every k-th record (k = round(1 / validation_fraction)) is held out, so the
    split is fixed. The files are read once to count records, check that all
    share one shape and find the number of classes.

    Args:
        pattern: a glob pattern or a comma-separated list of files or patterns.
        num_classes: number of labels; inferred as max label + 1 if None.
        validation_fraction: about this share of records is held out.

    Example:
        >>> data = load_tfrecord("/data/train-*.tfrecord")
        >>> data.info.input_shape
        (8, 8, 1)
    """
    files = _expand_files(pattern)
    if not 0 < validation_fraction < 1:
        raise ValueError(
            "validation_fraction must be between 0 and 1 (exclusive). "
            f"Received: validation_fraction={validation_fraction}"
        )
    holdout_every = max(2, round(1 / validation_fraction))
    shape, labels = _inspect(files, pattern)
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    elif labels.max() >= num_classes or labels.min() < 0:
        raise ValueError(
            f"Labels must be in [0, num_classes). Received: num_classes={num_classes}, "
            f"labels in [{labels.min()}, {labels.max()}] in {pattern!r}"
        )
    num_validation = (len(labels) + holdout_every - 1) // holdout_every
    features = {
        "x": tf.io.FixedLenFeature([int(np.prod(shape))], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(serialized):
        example = tf.io.parse_single_example(serialized, features)
        return tf.reshape(example["x"], shape), tf.cast(example["y"], tf.int32)

    indexed = tf.data.TFRecordDataset(list(files)).enumerate()
    train = indexed.filter(lambda index, _: index % holdout_every != 0)
    validation = indexed.filter(lambda index, _: index % holdout_every == 0)
    info = DataInfo(
        name="tfrecord",
        task=CLASSIFICATION,
        input_shape=shape,
        num_classes=num_classes,
        num_train_examples=len(labels) - num_validation,
        num_validation_examples=num_validation,
        x_dtype="float32",
    )
    return RecordData(
        files=files,
        train=train.map(lambda _, record: parse(record), num_parallel_calls=tf.data.AUTOTUNE),
        validation=validation.map(lambda _, record: parse(record)),
        info=info,
    )


def _expand_files(pattern: str) -> tuple[str, ...]:
    files = set()
    for part in (part.strip() for part in pattern.split(",")):
        matches = tf.io.gfile.glob(part) if part else []
        if not matches:
            raise ValueError(
                "No TFRecord file matches data_path; pass a glob pattern or comma-separated "
                f"list of existing files. Received: data_path={pattern!r} (no match for {part!r})"
            )
        files.update(matches)
    return tuple(sorted(files))


def _inspect(files: tuple[str, ...], pattern: str) -> tuple[tuple[int, ...], np.ndarray]:
    """Returns the records' common shape and all labels, reading the files once."""
    features = {
        "shape": tf.io.VarLenFeature(tf.int64),
        "x": tf.io.VarLenFeature(tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }
    shapes, sizes, labels = [], [], []
    try:
        for serialized in tf.data.TFRecordDataset(list(files)).batch(_INSPECTION_BATCH):
            parsed = tf.io.parse_example(serialized, features)
            shapes.append(tf.sparse.to_dense(parsed["shape"], default_value=-1).numpy())
            rows = tf.cast(parsed["x"].indices[:, 0], tf.int32)
            sizes.append(tf.math.bincount(rows, minlength=len(parsed["y"])).numpy())
            labels.append(parsed["y"].numpy())
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
        raise ValueError(
            "data_path must hold tf.train.Example records with features 'x' (floats), "
            f"'shape' (int64s) and 'y' (one int64). Received: data_path={pattern!r} "
            f"({error.message.splitlines()[0]})"
        ) from None
    if not labels:
        raise ValueError(f"The TFRecord files hold no records. Received: data_path={pattern!r}")
    width = max(batch.shape[1] for batch in shapes)
    all_shapes = np.concatenate(
        [
            np.pad(batch, ((0, 0), (0, width - batch.shape[1])), constant_values=-1)
            for batch in shapes
        ]
    )
    distinct = np.unique(all_shapes, axis=0)
    if len(distinct) != 1:
        raise ValueError(
            f"All records must share one shape; found {len(distinct)} shapes. "
            f"Received: shapes {[tuple(s[s >= 0]) for s in distinct[:3]]} in {pattern!r}"
        )
    shape = tuple(int(size) for size in distinct[0] if size >= 0)
    all_sizes = np.concatenate(sizes)
    if not (all_sizes == int(np.prod(shape))).all():
        raise ValueError(
            f"Each record's 'x' must hold prod(shape)={int(np.prod(shape))} floats. "
            f"Received: sizes from {all_sizes.min()} to {all_sizes.max()} in {pattern!r}"
        )
    return shape, np.concatenate(labels)
