"""What ops cost on a described device: compute time (``compute``), memory (``memory``, with the
dtypes autocast holds in ``dtypes``), the least-squares refits of their coefficients from
measured steps (``refit``), and the host allocator regime the prices assume
(``host_allocator``). The descriptions they price on live one layer down, in
``autoplan.cluster``; measuring this machine, one layer up, in ``autoplan.machine``."""
