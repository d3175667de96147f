"""Print one command of the README's quick start: `main` (the first) or `test` (the second)."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_commands() -> list[str]:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    if len(commands) != 2:
        raise SystemExit(f"README quick start must hold exactly two commands, found {len(commands)}")
    return commands


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "test"
    print(quick_start_commands()[{"main": 0, "test": 1}[which]])
