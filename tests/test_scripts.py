"""The README's two commands: the demo sets up only what it runs, in its own environment, with
torch pinned and installed first; the test command keeps everything the suite needs. (Running
the demo's set-up here would download ~1 GB: it is checked by reading the scripts.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("tensorflow", "tf-keras", "jax", "optax", "flax", "ray", "pyspark", "mpi4py", "[test]",
         "setup.sh")


def code_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_demo_installs_torch_first_pinned_then_hora_in_its_own_environment() -> None:
    lines = code_lines(ROOT / "scripts" / "demo.sh")
    text = "\n".join(lines)
    assert "ENV=.venv-demo" in text and ".venv/" not in text, "its own environment"
    assert 'TORCH="torch==2.13.0"' in text
    installs = [line for line in lines if "$INSTALL " in line]
    assert len(installs) == 2, installs
    assert installs[0].split()[1] == '"$TORCH"', "torch first, pinned"
    assert '"$TORCH"' in installs[1] and '-e ".[torch]"' in installs[1], \
        "hora with the pin again, so pip cannot pick another torch"
    assert not [word for word in HEAVY if word in text], "only what the demo runs"
    assert "examples/torch_digits.py" in text


def test_the_demo_environment_is_ignored_by_git_and_the_extra_is_light() -> None:
    assert ".venv-demo/" in (ROOT / ".gitignore").read_text().split()
    extra = re.search(r"^torch = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra is not None
    assert sorted(p.strip().strip('"') for p in extra.group(1).split(",")) == [
        "scikit-learn", "torch>=2.0", "tqdm"]


def test_the_test_command_still_sets_up_everything() -> None:
    setup = "\n".join(code_lines(ROOT / "scripts" / "setup.sh"))
    for package in ("torch==2.13.0", "tensorflow-cpu==", "tf-keras==", "jax==", "ray==",
                    "pyspark==", "mpi4py==", '-e ".[test]"'):
        assert package in setup, package
    assert "bash scripts/setup.sh" in (ROOT / "scripts" / "test.sh").read_text()


def test_readme_first_screen_has_both_commands_and_the_cpu_wheel_note() -> None:
    first = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    assert len(first.splitlines()) <= 30, "a first screen"
    commands = [line for line in first.splitlines() if line.startswith("bash scripts/")]
    assert [c.split("#")[0].strip() for c in commands] == ["bash scripts/demo.sh",
                                                          "bash scripts/test.sh"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in first
    assert "docs/migrating-from-horovod.md" in first
