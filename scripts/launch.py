"""Runs `tfmulti-launch` from a checkout; see tfmulti/cli/launch.py for its flags and examples.

On Linux the workers run in a private network holding only loopback, out of other
machines' reach; `--isolation=namespace` (or `TFMULTI_ISOLATION`) refuses to start without
one, `none` skips it (docs/guide/multi_worker.md#security).

Example:
    python scripts/launch.py --help   # its flags, by group; --helpfull adds absl's, TensorFlow's
"""

from tfmulti.cli.launch import main

if __name__ == "__main__":
    main()
