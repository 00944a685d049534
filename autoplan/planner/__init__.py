"""Planning: per-op sharding strategies, the sharding ILP, the search, and the plan file.

Kept light on import: the cost model imports ``autoplan.planner.sharding`` and the search imports
the cost model, so this package's ``__init__`` imports nothing heavy.
"""
