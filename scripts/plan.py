"""Runs `tfmulti-plan` from a checkout; see tfmulti/cli/plan.py for its flags and examples.

Example:
    python scripts/plan.py --help   # its flags, by group; --helpfull adds absl's, TensorFlow's
"""

from tfmulti.cli.plan import main

if __name__ == "__main__":
    main()
