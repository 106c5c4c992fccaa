"""The negotiated engine and the process's one running instance of it. It owns the background
thread and its cycle (``engine``, ``dispatch``), rank 0's coordinator that pairs the members'
requests and orders the responses (``coordinator``), stall and deadlock checks (``deadlock``),
heartbeats and abort reasons (``liveness``), the response cache across hosts (``cross_cache``:
slots, ready bits and rank 0's decisions; ``cross_link``: the engine's side of it), the timeline
tracing (``trace``), thread affinity
(``affinity``), and the per-process context that builds the engine at ``init()`` and answers
rank / size / process-set queries (``context``, ``set_queries``). It sits on top of the other
core subpackages and may import :mod:`hora.core.op`, :mod:`hora.core.data`,
:mod:`hora.core.lane` and :mod:`hora.core.autotune`, plus the collectives, transports,
rendezvous, timeline and base layers; never :mod:`hora.core.frontend`.
"""
