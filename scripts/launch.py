"""Runs `tfmulti-launch` from a checkout; see tfmulti/cli/launch.py for its flags and examples.

Example:
    python scripts/launch.py --help   # its flags, by group; --helpfull adds absl's, TensorFlow's
"""

from tfmulti.cli.launch import main

if __name__ == "__main__":
    main()
