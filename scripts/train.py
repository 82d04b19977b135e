"""Runs `tfmulti-train` from a checkout; see tfmulti/cli/train.py for its flags and examples.

Example:
    python scripts/train.py --helpfull
"""

from tfmulti.cli.train import main

if __name__ == "__main__":
    main()
