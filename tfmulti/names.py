"""The names users pick from on the command line, kept free of TensorFlow imports.

The modules that implement each name check against these tuples in tests.
"""

STRATEGY_NAMES = ("one_device", "mirrored", "multi_worker")
STAGED_STRATEGY_NAMES = ("pipeline", "model_parallel")
HYBRID_STRATEGY_NAME = "hybrid"
KERAS_MODEL_PARALLEL_NAME = "keras_model_parallel"
TRAIN_STRATEGY_NAMES = (
    STRATEGY_NAMES + STAGED_STRATEGY_NAMES + (HYBRID_STRATEGY_NAME, KERAS_MODEL_PARALLEL_NAME)
)
ALL_REDUCE_NAMES = ("auto", "nccl", "hierarchical_copy", "reduce_to_one_device")
TENSOR_REDUCTION_NAMES = ("ring", "collective")
MODEL_NAMES = ("mlp", "convnet", "resnet", "transformer")
DATASET_NAMES = ("synthetic", "digits", "npz", "tfrecord", "tokens")
# Set by scripts/launch.py on every worker: 0 on the first start, then the restart number.
RESTART_COUNT_VARIABLE = "TFMULTI_RESTART_COUNT"
# A worker that saved a checkpoint on SIGTERM exits with this ("restart me"), TensorFlow's
# own default for a preempted job.
PREEMPTED_EXIT_CODE = 42
