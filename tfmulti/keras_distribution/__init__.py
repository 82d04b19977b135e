"""Keras 3's `keras.distribution` on TensorFlow: layouts turned into weight shards on a mesh."""
