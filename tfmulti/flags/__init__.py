"""absl flag groups for tfmulti's scripts, defined once, with validators.

These modules import no TensorFlow, so a bad flag is reported in one line
before TensorFlow starts. Library code never reads flags: scripts turn them
into plain values (see `training_flags.config_from_flags`).
"""
