"""The fast lane: the steady state without negotiation. Once a process set's ops repeat, every
member logs each op's slot on a shared-memory board, the group's leader publishes the order,
and each member runs the learned response with no round trip to the coordinator. It owns the
one interface with the negotiated engine (``engine_side``: which calls cross it, on which
thread), the lanes per set (``lanes``), the lane itself (``fastlane``), what it has learned
(``lane_cache``) and the leader's side (``lane_leader``). It may import :mod:`hora.core.op` and
:mod:`hora.core.data` (it runs ops through an executor and a route), the transports and the
base layer; never the engine, autotune or the front-end.
"""
