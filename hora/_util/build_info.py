"""What hora is built with, in Horovod's terms: the one answer ``hvd.mpi_built()``,
``gloo_built()``, ``nccl_built()``... give and ``hora check -cb`` prints. hora has its own engine
(TCP between hosts, shared memory on a host) and controller; ``mpirun`` / ``srun`` /
``torchrun`` can start hora jobs. Its tensor operations can also run on MPI (the ``mpi`` data
plane, through mpi4py) and on Gloo (the ``torch`` data plane, torch.distributed's gloo): those
are available when their package is installed, which :func:`mpi_ops` and :func:`gloo_ops`
answer. No NCCL, DDL or CCL. Standard library only."""

from __future__ import annotations

from importlib.util import find_spec


def mpi_ops() -> bool:
    """Whether the ``mpi`` data plane can run here (mpi4py is installed)."""
    return find_spec("mpi4py") is not None


def gloo_ops() -> bool:
    """Whether the ``torch`` data plane (torch.distributed's gloo) can run here."""
    return find_spec("torch") is not None


NCCL = 0  # Horovod's nccl_built() is the NCCL version number, 0 without NCCL
DDL = False
CCL = False
CUDA = False
ROCM = False

ENGINE = "hora (TCP between hosts, shared memory on a host)"
"""What plays the part of Horovod's controller and tensor operations."""
