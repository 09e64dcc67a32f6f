"""The segments of an .sgm or .xml test set (WMT's, IWSLT's), as sacrebleu reads them: the text of
each `<seg ...>` line, spacing squeezed. For feedback-score's references and the test sets of data_prep."""

import re
from typing import Iterable, List

_SEG = re.compile(r"<seg[^>]*>(.*)</seg>")


def segments(lines: Iterable[str]) -> List[str]:
    found = (_SEG.search(line) for line in lines if "<seg" in line)
    return [" ".join(m.group(1).split()) if m else "" for m in found]
