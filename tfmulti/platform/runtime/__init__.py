"""TensorFlow's runtime as a run meets it: logical devices, clusters and their strategies,
allocators, start-up and logging."""
