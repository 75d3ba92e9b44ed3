"""What a benchmark's numbers belong to: the tree they were measured on (written into every
result file beside the date and the machine)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def tree_commit() -> str | None:
    """HEAD's short hash, with ``+dirty`` when tracked files differ from it (then the numbers
    belong to a working tree, not to that commit); None outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return (head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None
