"""Reference models for tfmulti, each an ordered list of blocks and one keras.Model."""
