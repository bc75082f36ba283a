"""The P/D request coordinator and what it shares with every driver (sans-I/O).

``coordinator``  the request lifecycle, written once (events in, effects out, time passed in)
``sched``        the cooperative scheduler its flows run on
``state``        the request state table
``ops``          typed operations for ranks, their replies and the events ranks raise
``rank``         the executor that carries out operations on a rank (in process or remote)
``deployment``   a scenario's engines, layouts, pool sizes and requests
``pool``         block pools: allocation, owners, version stamps
``records``      request records and run results
"""
