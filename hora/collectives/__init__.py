"""Collective algorithms: pure functions over the small :class:`~hora.collectives.comm.Comm`
interface. No sockets, no threads, no framework types live here."""
