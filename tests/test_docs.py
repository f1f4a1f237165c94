"""What the documents cite exists: every test file, script and example the README, the pages
under docs/ and tests/README.md name by path, and the design notes the tests cite."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

DOCS = ["README.md", "tests/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|scripts|examples|docs)/[\w/.-]+\.(?:py|yaml|sh|md))")


def test_every_path_the_documents_cite_exists():
    missing = [f"{doc}: {path}" for doc in DOCS for path in PATH.findall((ROOT / doc).read_text())
               if not (ROOT / path).exists()]
    assert missing == [], missing


def test_the_cli_help_of_every_command(capsys):
    """``elasticrl``, ``elasticrl --help`` and every command's ``--help`` print their text (a
    help holding ``[/N]`` once ended them in rich's markup error), each docstring whole."""
    from elasticrl.cli import app

    def help_of(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_:
            app([*args], prog_name="elasticrl")
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err
        return exit_.value.code, " ".join((out.out + out.err).split())

    docs = {c.name or c.callback.__name__: " ".join(c.callback.__doc__.split()) for c in app.registered_commands}
    code, top = help_of("--help")
    assert code == 0 and all(f" {name} " in top for name in docs), top
    assert help_of()[1] == top  # no arguments: the same help (click exits 2 there)
    for name, doc in docs.items():
        code, text = help_of(name, "--help")
        assert code == 0 and text.startswith(f"Usage: elasticrl {name} ") and doc in text, (name, text)
