"""The fenced blocks of the Markdown pages, each with the marker on the line above it
(tests/test_docs.py holds the shell blocks to their tests; tests/test_torch_range.py reads the
install block)."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
SHELL = {"", "bash", "sh", "shell", "console"}


@dataclass
class Block:
    page: Path
    line: int
    language: str
    text: str
    marker: str  # the HTML comment on the line above, without <!-- -->; "" if none

    def __str__(self):
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def is_shell(self):
        return self.language in SHELL


def fenced_blocks(page: Path) -> List[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"\s*```\s*([\w+-]*)\s*$", lines[i])
        if opening:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{page.relative_to(REPO)}:{i + 1}: a fence that is never closed"
            above = lines[i - 1].strip() if i else ""
            marker = re.fullmatch(r"<!--\s*(.*?)\s*-->", above)
            blocks.append(Block(page, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                                marker.group(1) if marker else ""))
            i = end
        i += 1
    return blocks
