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
# The flags that only some strategies take, said once per strategy: a strategy refuses
# any of them set away from its default unless it is listed here.
STRATEGY_FLAGS = {
    "one_device": ("jit_compile",),
    "mirrored": ("zero",),
    "multi_worker": ("zero",),
    "pipeline": ("jit_compile", "trace_steps", "rolled"),
    "model_parallel": ("jit_compile", "placement", "tensor_parallel"),
    HYBRID_STRATEGY_NAME: ("jit_compile", "mesh", "cross_host_axis", "zero"),
    KERAS_MODEL_PARALLEL_NAME: ("mesh", "layout_map"),
}
# Why a strategy refuses a flag, where the name alone does not say.
STRATEGY_FLAG_REASONS = {
    "jit_compile": "Keras 3 cannot compile a tf.distribute replica's step, nor a "
    "keras.distribution layout's, with XLA: keras-team/keras#19005",
    "rolled": "it traces every action of a pipeline; hybrid steps always roll",
    "trace_steps": "it records a pipeline's schedule, not yet a hybrid's",
}
ALL_REDUCE_NAMES = ("auto", "nccl", "hierarchical_copy", "reduce_to_one_device")
TENSOR_REDUCTION_NAMES = ("ring", "collective")
MODEL_NAMES = ("mlp", "convnet", "resnet", "transformer")
DATASET_NAMES = ("synthetic", "digits", "npz", "tfrecord", "tokens")
# Set by scripts/launch.py on every worker: 0 on the first start, then the restart number.
RESTART_COUNT_VARIABLE = "TFMULTI_RESTART_COUNT"
# Set by SLURM on a job it requeued (after a node failure or `scontrol requeue`).
SLURM_RESTART_COUNT_VARIABLE = "SLURM_RESTART_COUNT"
# A worker that saved a checkpoint on SIGTERM exits with this ("restart me"), TensorFlow's
# own default for a preempted job.
PREEMPTED_EXIT_CODE = 42
