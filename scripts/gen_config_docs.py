"""Regenerate docs/config.md from the knob table (hora.config.KNOBS)."""

from __future__ import annotations

from pathlib import Path

from hora.config import markdown_table

HEADER = """# Configuration knobs

Generated from `hora/config.py` by `python scripts/gen_config_docs.py`; do not edit by hand.

Every knob is read from its `HORA_*` variable first, then from Horovod's `HOROVOD_*` alias.
`hora run` flags set the `HORA_*` variable for every rank. An unknown `HORA_*` variable or a
malformed value is an error that names the knob. An unknown `HOROVOD_*` variable (other than
the identity, build and GPU-library variables Horovod defines) gets a warning from rank 0 with
the closest known name: Horovod ignores unknown names, so hora does not refuse them.

"""


def render() -> str:
    return HEADER + markdown_table()


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    out.write_text(render())
    print(f"wrote {out}")
