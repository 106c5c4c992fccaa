"""What an op is, in the words every other part of the core shares: the wire messages
(``Request`` / ``Response`` and their encoding), an op's ``Entry`` and ``Handle``, process sets,
the naming of unnamed ops, the cross-rank agreement checks (dtype, shape, op, root) and the
``DeviceBuffer`` interface an adapter's device tensors implement. It owns no thread and no
state beyond one op's. It may import only the base layer (``hora.errors``, ``hora.config``,
``hora._util``) and itself; every other core subpackage may import it.
"""
