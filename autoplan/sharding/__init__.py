"""Sharding values and the per-op strategy registry: what cost, search and runtime all speak.

- ``placement``: how one tensor lies on one mesh axis (``R``, ``S(d)``, ``P``);
- ``dims``: where a sharded dim goes through views, permutes, slices and broadcasts;
- ``strategies``: per op, the ways it can run on a ``t``-way axis (one rule per op family);
- ``sharding``: one strategy per op of a graph, the placements and reshards that follow, and
  Megatron-LM's rule;
- ``mesh_axes``: the mesh axes as a type (``MeshAxis``, what each may carry) and
  ``ParallelDims``: their degrees, the rank layout, the group of a rank on any set of axes, the
  device mesh's shape and names;
- ``parallel_config``: ``ParallelConfig``, one point of the search space (degrees and
  policies), and the schedule and recompute vocabularies.

It sits between ``graph`` and ``cost``: it reads an OpGraph and imports nothing above it.
"""
