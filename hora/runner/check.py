"""``hora check`` / ``hora run -cb``: what this installation can do.

Runner layer. Reports hora's version, Python, numpy, bfloat16 support, the frameworks hora has
adapters for, the transports and launchers available, the Horovod settings whose effect hora
does not have (refused: from the knob table), and the same facts in ``horovodrun
--check-build``'s checklist format. Nothing heavy is imported: packages are probed with
:func:`importlib.util.find_spec` and :func:`importlib.metadata.version`, and hora's own optional
modules by looking for their files.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hora._util import build_info as build
from hora.config import KNOBS, accepted_text

HOROVOD_API_VERSION = "0.28.1"
"""The Horovod release whose API and ``horovodrun`` flags hora follows."""

_HORA_DIR = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Probe:
    """One line of the report: a capability, whether it is there, and a detail."""

    name: str
    available: bool
    detail: str = ""


def hora_version() -> str:
    """The installed hora version (``"unknown"`` when running from a bare source tree)."""
    try:
        return importlib.metadata.version("hora")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def dist_version(*names: str) -> str | None:
    """Version of the first installed distribution among ``names``, or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def importable(module: str) -> bool:
    """Whether top-level ``module`` can be imported (found on the path; not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def hora_has(module: str) -> bool:
    """Whether hora ships the optional module ``module`` (dotted, relative to ``hora``)."""
    path = _HORA_DIR.joinpath(*module.split("."))
    return (path / "__init__.py").is_file() or path.with_suffix(".py").is_file()


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module) if importable(module) else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build (by its files; torch is not imported)."""
    version = dist_version("torch") or ""
    if "+cpu" in version:
        return False
    lib = _package_dir("torch")
    return lib is not None and any((lib / "lib").glob("libtorch_cuda*"))


def _framework(label: str, module: str, dists: tuple[str, ...], adapter: str,
               install: str) -> Probe:
    version = dist_version(*dists) if importable(module) else None
    if version is None:
        return Probe(label, False, f"not installed ({install})")
    if not hora_has(adapter):
        return Probe(label, False, f"{version} installed; hora.{adapter} not yet available")
    return Probe(label, True, f"{version} (import hora.{adapter} as hvd)")


def probes() -> dict[str, list[Probe]]:
    """Every capability hora knows about, by section."""
    numpy_v = dist_version("numpy")
    ml_dtypes_v = dist_version("ml_dtypes", "ml-dtypes")
    torch_v = dist_version("torch") if importable("torch") else None
    mpi4py_v = dist_version("mpi4py") if importable("mpi4py") else None
    cuda = torch_v is not None and torch_has_cuda()
    mpirun = shutil.which("mpirun")
    srun = shutil.which("srun")
    return {
        "Core": [
            Probe("Python", True, f"{platform.python_version()} ({sys.executable})"),
            Probe("numpy", numpy_v is not None, numpy_v or "missing: pip install numpy"),
            Probe("bfloat16", ml_dtypes_v is not None,
                  f"ml_dtypes {ml_dtypes_v}" if ml_dtypes_v else "pip install ml_dtypes"),
        ],
        "Frameworks": [
            _framework("PyTorch", "torch", ("torch",), "torch", "pip install torch"),
            _framework("TensorFlow", "tensorflow",
                       ("tensorflow", "tensorflow-cpu", "tensorflow-gpu"), "tensorflow",
                       "pip install tensorflow-cpu"),
            _framework("Keras", "keras", ("keras",), "keras", "pip install tensorflow-cpu"),
            _framework("JAX", "jax", ("jax",), "jax", "pip install jax"),
        ],
        "Transports": [
            Probe("tcp", hora_has("transports.tcp"), "any host; hora's default"
                  if hora_has("transports.tcp") else "not yet"),
            Probe("shm", hora_has("transports.shm"), "same host" if hora_has("transports.shm")
                  else "not yet (same-host ranks use tcp over loopback)"),
            Probe("mpi4py", mpi4py_v is not None and hora_has("transports.mpi_plane"),
                  _optional(mpi4py_v, "mpi4py", "transports.mpi_plane")
                  + ("; the mpi data plane (--data-plane mpi)" if mpi4py_v else "")),
            Probe("torch.distributed gloo",
                  torch_v is not None and hora_has("transports.torch_plane"),
                  _optional(torch_v, "torch", "transports.torch_plane")
                  + ("; the torch data plane (--data-plane torch)" if torch_v else "")),
            Probe("torch.distributed nccl",
                  cuda and hora_has("transports.torch_plane"),
                  ("CPU-only torch build" if torch_v is not None and not cuda
                   and hora_has("transports.torch_plane")
                   else _optional(torch_v, "torch (CUDA build)" if cuda else "torch",
                                  "transports.torch_plane")
                   + ("; CUDA tensors stay on the GPU with --data-plane torch" if cuda
                      else ""))),
        ],
        "Launchers": [
            Probe("hora run", True, "this host, and other hosts over ssh (-H, --hostfile)"
                  + ("; elastic (--min-np, --host-discovery-script)" if hora_has("elastic")
                     else "; elastic: not yet")),
            Probe("mpirun", mpirun is not None,
                  f"{mpirun}: `mpirun -np N python train.py` needs no hora run; `hora run "
                  "--data-plane mpi` starts the ranks through it" if mpirun else "not found"),
            Probe("srun", srun is not None,
                  f"{srun}: `srun -n N python train.py` needs no hora run" if srun
                  else "not found"),
            Probe("torchrun", torch_v is not None,
                  "`torchrun --nproc-per-node N train.py` needs no hora run" if torch_v
                  else "comes with torch"),
        ],
        "Horovod settings": _settings(),
    }


def _settings() -> list[Probe]:
    """Horovod settings whose effect depends on the platform, or that hora refuses (from the
    knob table, so this cannot drift from what ``init()`` does)."""
    pin = hasattr(os, "sched_setaffinity")
    sklearn = dist_version("scikit-learn") if importable("sklearn") else None
    rows = [Probe("HOROVOD_THREAD_AFFINITY", pin, "pins the engine's background threads, one "
                  "core per local rank" if pin else "needs Linux: setting it is refused"),
            Probe("HOROVOD_AUTOTUNE", sklearn is not None,
                  f"tunes the fusion threshold and cycle time while training (scikit-learn "
                  f"{sklearn})" if sklearn is not None else "needs scikit-learn (pip install "
                  "scikit-learn): without it, asking for autotune fails at init()")]
    for knob in KNOBS:
        if not knob.unsupported:
            continue
        name = knob.alias or knob.env
        accepted = f"{accepted_text(knob)} accepted"
        reason = knob.unsupported.split(":")[0].split(".")[0]
        rows.append(Probe(name, False, f"{reason}: {accepted}, other values refused"))
    return rows


def _optional(version: str | None, package: str, module: str) -> str:
    if version is None:
        return f"{package} not installed"
    if not hora_has(module):
        return f"{package} {version} installed; hora.{module} not yet available"
    return f"{package} {version}"


def _found(section: list[Probe], name: str) -> bool:
    return any(p.available for p in section if p.name == name)


def check_build_text(found: dict[str, list[Probe]] | None = None) -> str:
    """The report in ``horovodrun --check-build``'s format.

    The tensor-operation rows agree with ``hvd.mpi_built()``, ``gloo_built()``,
    ``nccl_built()``... (one answer: :mod:`hora._util.build_info`); hora's own engine is listed
    as what it is, and it is the only controller.
    """
    found = probes() if found is None else found
    frameworks = found["Frameworks"]

    def row(flag: bool, name: str) -> str:
        return f"    [{'X' if flag else ' '}] {name}"

    lines = [f"hora v{hora_version()}:", "", "Available Frameworks:",
             row(_found(frameworks, "TensorFlow"), "TensorFlow"),
             row(_found(frameworks, "PyTorch"), "PyTorch"),
             row(False, "MXNet"),
             row(_found(frameworks, "JAX"), "JAX"),
             "", "Available Controllers:",
             row(False, "MPI"),
             row(False, "Gloo"),
             row(True, build.ENGINE),
             "", "Available Tensor Operations:",
             row(bool(build.NCCL), "NCCL"),
             row(build.DDL, "DDL"),
             row(build.CCL, "CCL"),
             row(build.mpi_ops(), "MPI (data plane mpi, mpi4py)"),
             row(build.gloo_ops(), "Gloo (data plane torch, torch.distributed)"),
             row(True, build.ENGINE)]
    return "\n".join(lines) + "\n"


def report_text(found: dict[str, list[Probe]] | None = None) -> str:
    """hora's own report: every probe with its detail."""
    found = probes() if found is None else found
    title = (f"hora {hora_version()} (Horovod {HOROVOD_API_VERSION} API) on "
             f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs")
    lines = [title]
    for section, items in found.items():
        lines += ["", f"{section}:"]
        width = max(len(p.name) for p in items)
        lines += [f"    [{'X' if p.available else ' '}] {p.name:<{width}}  {p.detail}".rstrip()
                  for p in items]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, *, checklist_first: bool = False) -> int:
    """``hora check``: print the report and the ``--check-build`` checklist. Exit 0.

    Args:
        argv: arguments after ``check``: ``-h`` / ``--help``, and ``-cb`` / ``--check-build``
            (horovodrun's flag: the checklist first).
        checklist_first: print the Horovod-format checklist first (``hora run -cb``).
    """
    parser = argparse.ArgumentParser(
        prog="hora check", description="Show what this hora installation can do: frameworks, "
        "transports, launchers, the Horovod settings it refuses, and horovodrun "
        "--check-build's checklist.")
    parser.add_argument("-cb", "--check-build", action="store_true",
                        help="print horovodrun -cb's checklist first (as `hora run -cb` does)")
    ns = parser.parse_args(argv)
    found = probes()
    parts = [report_text(found), check_build_text(found)]
    if checklist_first or ns.check_build:
        parts.reverse()
    sys.stdout.write("\n".join(parts))
    sys.stdout.flush()
    return 0


__all__ = ["HOROVOD_API_VERSION", "Probe", "check_build_text", "hora_version", "main", "probes",
           "report_text"]
