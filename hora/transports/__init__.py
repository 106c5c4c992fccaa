"""Transports: how bytes move between ranks (tcp, loopback). See :mod:`hora.transports.base`."""
