"""The data path: how the bytes of a negotiated op move. It owns the table of data planes
(``paths``: which engine moves a set's bytes, chosen by ``HORA_DATA_PLANE``), hora's own routes
and their table (shared memory, the tcp ring, hierarchical; ``routing``), the routes over
external data planes (torch.distributed and MPI; ``plane_route``), the executor that packs
fused ops into one buffer, runs the collective and unpacks the results (``executor``,
``fusion``, ``device_exec`` for device tensors), and the host-memory helpers adapters use
(``aligned``, ``packing``). It may import :mod:`hora.core.op`, the collectives, the transports
and the base layer; never the lane, the engine, autotune or the front-end.
"""
