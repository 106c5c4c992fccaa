"""What the framework adapters call: the core's API over buffers (``api``), the op forms
Horovod's spellings map onto (``op_forms``), grouped ops (``grouped``), the gradient rules and
the bridge adapters implement (``gradients``, ``host_bridge``), the distributed optimizer's
framework-neutral logic (``distopt``), compression and object collectives (``compression``,
``objects``). It is the top of the core: it may import every other core subpackage; nothing in
the core imports it, and adapters should import the core through it (plus
:mod:`hora.core.op.device`, :mod:`hora.core.data.aligned` / ``packing`` and
:mod:`hora.core.engine.context`).
"""
