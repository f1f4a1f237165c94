"""The layering rules of DESIGN.md and STYLE.md, checked on the source."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "elasticrl"
DEVICE_MODULE = PKG / "backend.py"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_only_the_backend_touches_the_device_api():
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if p != DEVICE_MODULE and "torch.cuda" in p.read_text()]
    assert offenders == [], f"ask elasticrl.backend instead: {offenders}"


def test_algorithms_are_pure_tensor_math():
    banned = ("ray", "deepspeed", "vllm", "torch.distributed", "elasticrl.cluster", "elasticrl.engine")
    for path in (PKG / "algorithms").rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(banned)]
        assert not bad, f"{path.name} imports {bad}"


def test_nothing_imports_the_cli():
    for path in PKG.rglob("*.py"):
        if path.name != "cli.py":
            assert "elasticrl.cli" not in _imports(path), path


def test_the_planner_is_arithmetic_on_the_spec():
    """`elasticrl plan` must answer in well under a second on a laptop: no distributed stack."""
    banned = ("ray", "deepspeed", "vllm", "torch", "elasticrl.cluster", "elasticrl.engine", "elasticrl.trainers")
    for path in (PKG / "plan").rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(banned)]
        assert not bad, f"{path.name} imports {bad}"
