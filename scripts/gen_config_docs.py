"""Regenerate docs/config.md from the knob table (hora.config.KNOBS)."""

from __future__ import annotations

from pathlib import Path

from hora.config import KNOBS, Knob, accepted_text, allowed_text

HEADER = """# Configuration knobs

Generated from `hora/knobs.py` by `python scripts/gen_config_docs.py`; do not edit by hand.

Every knob is read from its `HORA_*` variable first, then from Horovod's `HOROVOD_*` alias.
`hora run` flags set the `HORA_*` variable for every rank. An unknown `HORA_*` variable or a
malformed value is an error that names the knob. An unknown `HOROVOD_*` variable (other than
the identity, build and GPU-library variables Horovod defines) gets a warning from rank 0 with
the closest known name: Horovod ignores unknown names, so hora does not refuse them.

Every number must be finite and within the range in the `allowed` column: NaN, infinity, a
negative time, or 0 where 0 means nothing (a timeout of 0 would fail every op at once) is
refused, naming the knob, where it is set and the range, whether it comes from the
environment (either name), a `hora run` flag, a `--config-file` or `hora.run()`. Where 0 has a
meaning the column says which ("0: disabled"). Times are at most 1000000 seconds (11.6 days).

Every knob has an effect, or is refused. A Horovod knob whose effect hora does not have (the
torus allreduce, NCCL streams, the MPI controller, oneCCL CPU operations) accepts only the
value that matches what hora does: unset, or its default (`gloo` for `HOROVOD_CONTROLLER` and
`HOROVOD_CPU_OPERATIONS`, which `hora run` sets for every rank where its own environment does
not set them, as horovodrun does; `HOROVOD_CPU_OPERATIONS=mpi` selects the mpi data plane, and
`hora run` says so in one line). Any other value, whether from the environment, a `hora run`
flag or a `--config-file`, is refused (by `hora run` before anything starts, by `init()`
otherwise) with the reason and what to use instead; the last column gives both.
`HOROVOD_AUTOTUNE=1` tunes the fusion threshold and cycle time while training
([autotune.md](autotune.md)); the `HOROVOD_AUTOTUNE_*` settings only matter with it on.
`HOROVOD_MPI_THREADS_DISABLE` accepts 0 and 1: hora never initialises MPI, so neither thread
level is requested, as in Horovod's gloo mode.
`hora check` lists the refused settings.

"""


def markdown_table(knobs: tuple[Knob, ...] = KNOBS) -> str:
    """The knob table as Markdown; a knob hora refuses says so, why, and what to use instead."""
    rows = ["| knob | `HORA_*` env | Horovod alias | `hora run` flag | default | allowed | doc |",
            "|---|---|---|---|---|---|---|"]
    for k in knobs:
        note = ""
        if k.unsupported:
            note = (f" **Not supported** ({accepted_text(k)} accepted, other values "
                    f"refused): {k.unsupported}")
        rows.append(
            f"| {k.name} | `{k.env}` | {f'`{k.alias}`' if k.alias else '(hora-only)'} | "
            f"{f'`{k.cli}`' if k.cli else ''} | `{k.default!r}` | {allowed_text(k)} | "
            f"{k.doc}{note} |"
        )
    return "\n".join(rows) + "\n"


def render() -> str:
    return HEADER + markdown_table()


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    out.write_text(render())
    print(f"wrote {out}")
