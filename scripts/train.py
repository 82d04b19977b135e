"""Runs `tfmulti-train` from a checkout; see tfmulti/cli/train.py for its flags and examples.

Example:
    python scripts/train.py --help   # its flags, by group; --helpfull adds absl's, TensorFlow's
"""

from tfmulti.cli.train import main

if __name__ == "__main__":
    main()
