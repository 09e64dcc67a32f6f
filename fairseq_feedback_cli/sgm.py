"""The segments of an .sgm or .xml test set (WMT's, IWSLT's), as sacrebleu reads them: the text of
each `<seg ...>` line, spacing squeezed. For feedback-score's references and the test sets of data_prep.

A test set holds its segments one a line, in order, and each is paired by position with a sentence
of the other language or a hypothesis: a line that does not hold one whole `<seg>...</seg>` (its
closing tag lost, or two segments run together) would blank or shift every pair from there on, so
it stops the command, naming the line."""

import re
from typing import Iterable, List

from .command_line import fail

_SEG = re.compile(r"<seg\b[^>]*>(.*?)</seg>")
_OPENING = re.compile(r"<seg\b")


def segments(lines: Iterable[str], source: str) -> List[str]:
    found = []
    for number, line in enumerate(lines, 1):
        whole = _SEG.findall(line)
        if (whole or _OPENING.search(line) or "</seg>" in line) and not (
                len(whole) == len(_OPENING.findall(line)) == line.count("</seg>") == 1):
            fail(f"{source}, line {number}: not one whole <seg>...</seg>: a test set holds one segment a line, "
                 "opened and closed on it; mend the line, or fetch the file again")
        found += [" ".join(text.split()) for text in whole]
    return found
