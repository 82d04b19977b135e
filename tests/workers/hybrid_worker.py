"""One worker of a hybrid data x pipeline run across workers, driven by tests through TF_CONFIG.

Usage: python hybrid_worker.py --mesh=data=2,pipe=2 --devices=2 --schedule=1f1b --out=DIR
Trains on this worker's rows of each global batch with `fit`, then writes
DIR/worker<rank>.json with every local replica's weights and the loss history.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

from tfmulti.platform.runtime import cluster as cluster_lib  # noqa: E402
from tfmulti.platform.runtime.devices import configure_logical_devices  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 3
LEARNING_RATE = 0.01


def training_batches():
    """The global batches, the same on every worker and in the test's reference run; the
    last has 5 rows, which the workers share unevenly."""
    from pipeline_runtime_models import regression_batches

    partial = [(x[:5], y[:5]) for x, y in regression_batches(1, GLOBAL_BATCH, seed=1)]
    return regression_batches(STEPS, GLOBAL_BATCH) + partial


def make_stages(num_stages):
    """Seeded stages: the same initial weights on every worker and in the reference."""
    from pipeline_runtime_models import dense_stages

    return dense_stages(num_stages)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cluster = cluster_lib.resolve_cluster()
    configure_logical_devices(args.devices, device_type="CPU")
    cluster_lib.build_multi_worker_strategy(
        cluster, communication="ring", timeout_seconds=120, connect_timeout_seconds=150
    )

    import keras
    import numpy as np

    from tfmulti.hybrid import build_hybrid_model, worker_rows
    from tfmulti.platform.mesh import parse_mesh

    mesh = parse_mesh(args.mesh)
    model = build_hybrid_model(
        lambda: make_stages(mesh.pipe),
        mesh,
        args.microbatches,
        args.schedule,
        cluster=cluster,
        communication="ring",
        collective_timeout=120,
        cross_host_axis="data",
    )
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss="mse")
    batches = training_batches()
    x = np.concatenate([x for x, _ in batches])
    y = np.concatenate([y for _, y in batches])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    model(x[:GLOBAL_BATCH])
    history = model.fit(worker_rows(dataset, cluster), epochs=1, verbose=0)
    result = {
        "replica_weights": [[w.tolist() for w in r.get_weights()] for r in model.replicas],
        "replica_devices": [[v.value.device for v in r.weights] for r in model.replicas],
        "loss": history.history["loss"],
    }
    with open(os.path.join(args.out, f"worker{cluster.task_index}.json"), "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
