"""docs/engines.md's example engine, read from the page itself, so the tests serve the code the page shows."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def example() -> str:
    """The Python source under the page's 'A complete example' heading."""
    section = DOC.read_text().split("## A complete example", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "docs/engines.md lost its example"
    return found.group(1)
