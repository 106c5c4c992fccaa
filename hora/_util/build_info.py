"""What hora is built with, in Horovod's terms: the one answer ``hvd.mpi_built()``,
``gloo_built()``, ``nccl_built()``... give and ``hora check -cb`` prints. hora has its own engine
(TCP between hosts, shared memory on a host): no MPI, Gloo, NCCL, DDL or CCL inside, and
``mpirun`` / ``srun`` / ``torchrun`` can still start hora jobs. Standard library only."""

from __future__ import annotations

MPI = False
GLOO = False
NCCL = 0  # Horovod's nccl_built() is the NCCL version number, 0 without NCCL
DDL = False
CCL = False
CUDA = False
ROCM = False

ENGINE = "hora (TCP between hosts, shared memory on a host)"
"""What plays the part of Horovod's controller and tensor operations."""
