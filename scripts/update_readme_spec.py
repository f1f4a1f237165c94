"""Regenerate the spec reference table in README.md from the schema (``elasticrl spec --markdown``)."""
from pathlib import Path

from elasticrl.spec import describe

readme = Path(__file__).resolve().parent.parent / "README.md"
text = readme.read_text()
head = "| field | default | meaning |\n|---|---|---|\n"
start = text.index(head) + len(head)
end = text.index("\n## ", start)
rows = "".join(f"| `{path}` | `{default}` | {doc} |\n" for path, default, doc in describe())
readme.write_text(text[:start] + rows + text[end:])
