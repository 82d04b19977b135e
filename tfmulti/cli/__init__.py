"""The bodies of tfmulti's command-line tools, installed as console commands.

`tfmulti-train`, `tfmulti-launch` and `tfmulti-plan` call each module's `main()`;
`python scripts/train.py` (and launch.py, plan.py) call the same functions. Each module
defines its absl flags when imported, so import only the one a process runs.
"""
