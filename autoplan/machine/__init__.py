"""This machine, measured: the device figures the cost model falls back on (``calibration``),
op timings (``profiler``, with the timing primitives of ``timing``) and the first-use
calibration of a CPU without a profile (``first_use``, which ``Cluster.local()`` runs as a
program of its own).

It sits above ``cluster`` (the descriptions it names this machine's device in, and whose
``ProfileDB`` it writes) and ``cost`` (the formulas its fits use), so that neither of those
imports anything that measures.
"""
