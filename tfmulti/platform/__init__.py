"""Where a run executes: logical devices, meshes, clusters, strategies and the local launcher."""
