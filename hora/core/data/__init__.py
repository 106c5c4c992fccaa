"""The data path: how the bytes of a negotiated op move. It owns the table of data planes
(``paths``: which engine moves a set's bytes, chosen by ``HORA_DATA_PLANE``), hora's own routes
and their table (shared memory, the tcp ring, hierarchical; ``routing``), the routes over
external data planes (torch.distributed and MPI; ``plane_route``), the executor that fuses
ops (over shared memory each tensor is reduced where it lives; elsewhere packed into one
buffer and unpacked), runs the collective and completes the ops (``executor``, ``fusion``,
``host_forms`` and ``device_exec`` for the other collectives' host and device forms), and the
host-memory helpers adapters use
(``aligned``, ``packing``). It may import :mod:`hora.core.op`, the collectives, the transports
and the base layer; never the lane, the engine, autotune or the front-end.
"""
