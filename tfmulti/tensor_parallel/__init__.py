"""Tensor parallelism: Megatron-style split layers, their plain-Keras export and traffic."""
