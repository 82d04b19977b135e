"""Sums and gathers across devices and workers: rings of placed ops and TensorFlow's collectives."""
