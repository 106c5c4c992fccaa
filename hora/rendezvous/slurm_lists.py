"""Slurm's compressed list syntax: host lists (``node[01-03]``) and task counts (``2(x3),1``).

:mod:`hora.rendezvous.env` expands ``SLURM_STEP_NODELIST`` and ``SLURM_STEP_TASKS_PER_NODE`` with
these to find the step's first host (where rank 0 serves the store) and this host's rank count.
"""

from __future__ import annotations

import re

from hora.errors import RendezvousError


def expand_nodelist(text: str, variable: str = "nodelist") -> list[str]:
    """Expand Slurm's compressed host list: ``"node[01-03,7],gpu1"`` -> node01..03, node7, gpu1.

    Zero padding follows the lower bound's width; several bracket groups in one name expand as a
    product (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2).

    Raises:
        RendezvousError: unbalanced brackets or a malformed range, naming ``variable``.
    """
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise RendezvousError(f"{variable}={text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            part = text[start:i].strip()
            if part:
                names += _expand_one(part, text, variable)
            start = i + 1
    if depth != 0:
        raise RendezvousError(f"{variable}={text!r}: unbalanced brackets")
    return names


def _expand_one(part: str, text: str, variable: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", part)
    if match is None:
        return [part]
    prefix, suffix = part[:match.start()], part[match.end():]
    values: list[str] = []
    for item in match.group(1).split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise RendezvousError(f"{variable}={text!r}: malformed range {item!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise RendezvousError(f"{variable}={text!r}: descending range {item!r}")
        values += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return [prefix + v + rest for v in values for rest in _expand_one(suffix, text, variable)]


def expand_tasks_per_node(text: str, variable: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's ``"2(x3),1"`` task counts to ``[2, 2, 2, 1]``.

    Raises:
        RendezvousError: malformed text, naming ``variable``.
    """
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise RendezvousError(f"{variable}={text!r}: cannot parse {item!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


__all__ = ["expand_nodelist", "expand_tasks_per_node"]
