"""Regenerate the spec reference table of docs/spec.md from the schema (``elasticrl spec --markdown``
prints the same rows); tests/spec/test_spec.py fails while the page differs from it."""
from pathlib import Path

from elasticrl.spec import describe

HEAD = "| field | default | meaning |\n|---|---|---|\n"


def table() -> str:
    return "".join(f"| `{path}` | `{default}` | {doc} |\n" for path, default, doc in describe())


def write(page: Path) -> None:
    text = page.read_text()
    start = text.index(HEAD) + len(HEAD)
    end = text.find("\n\n", start)
    page.write_text(text[:start] + table() + text[end + 1 if end >= 0 else len(text):])


if __name__ == "__main__":
    write(Path(__file__).resolve().parent.parent / "docs" / "spec.md")
