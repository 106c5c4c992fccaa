"""The docs speak of the product: nothing a user cannot see (planning issues, briefs, internal
references), and the help agrees with the knob table."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INTERNAL = re.compile(r"\bissue \d+|\bthe brief\b|\bAppendix [A-Z]\b|\bquirk \d+|"
                      r"\bthe (elastic|core|shared-memory) issue\b|\bbefore issue\b", re.I)


def test_docs_cite_nothing_a_user_cannot_see() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in DOCS for n, line in enumerate(path.read_text().splitlines(), 1)
             if INTERNAL.search(line)]
    assert not found, "internal references in user docs:\n" + "\n".join(found)


def test_help_shows_automatic_for_knobs_without_a_fixed_default() -> None:
    from hora.config import KNOBS
    from hora.runner.run_flags import build_run_parser

    text = build_run_parser().format_help()
    for knob in KNOBS:
        if knob.type is bool and knob.default is None and knob.cli:
            block = text[text.index(knob.cli):]
            block = block[:block.index("]") + 1]
            assert "[default: automatic;" in block, block
