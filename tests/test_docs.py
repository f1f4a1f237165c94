"""What the documents cite exists: every test file, script and example the README, the
benchmarks' README and the design notes name by path, and the design notes the tests cite."""
from __future__ import annotations

import re

from tests.conftest import ROOT

DOCS = ["README.md", "benchmarks/README.md", "docs/DESIGN.md", "docs/STYLE.md", "tests/README.md"]
PATH = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|scripts|examples|docs)/[\w/.-]+\.(?:py|yaml|sh|md))")


def test_every_path_the_documents_cite_exists():
    missing = [f"{doc}: {path}" for doc in DOCS for path in PATH.findall((ROOT / doc).read_text())
               if not (ROOT / path).exists()]
    assert missing == [], missing
