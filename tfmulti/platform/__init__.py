"""Where a run executes: `launching/` starts and watches the worker processes (no
TensorFlow), `runtime/` sets up TensorFlow in each (logical devices, clusters, strategies),
and `mesh.py` says how a run splits its devices (pure Python, read by both and the planner).
"""
