"""A training job: building the model, callbacks, checkpoints, resume, preemption and records."""
