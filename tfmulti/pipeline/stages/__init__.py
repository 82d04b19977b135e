"""Cutting a Keras model into pipeline stages: at call-graph boundaries or over a block list."""
