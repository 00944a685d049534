"""Planning: the sharding ILP, the search over meshes and policies, and the plan file.

The per-op strategies it chooses from live one layer down, in ``autoplan.sharding``.
"""
