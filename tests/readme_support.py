"""Reading README.md's shell steps, to run them in tests as a reader would."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def section(heading: str) -> str:
    """The text of the README section ``## heading``, up to the next ``## ``."""
    text = README.read_text("utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.DOTALL)


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comment lines dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [line for line in joined.splitlines() if line.strip()
            and not line.lstrip().startswith("#")]


def localize(command: str, root: Path) -> str:
    """A root command runnable by anyone under ``root``: without sudo and chown options,
    with /etc/jobd and /opt/jobd moved below ``root``."""
    command = re.sub(r"\bsudo\s+", "", command)
    command = re.sub(r"\s-o\s+\S+\s+-g\s+\S+", "", command)
    for system_dir in ("/etc/jobd", "/opt/jobd"):
        command = command.replace(system_dir, f"{root}{system_dir}")
    return command


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)
