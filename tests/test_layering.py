"""The layering rules of docs/DESIGN.md and docs/STYLE.md, checked on the source and on what importing a
layer really loads (in a fresh interpreter, so that nothing imported by another test counts)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "elasticrl"
TREE = [p for folder in ("elasticrl", "launch", "components") for p in (ROOT / folder).rglob("*.py")]
DEVICE_MODULE = PKG / "backend.py"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


# The packages from the bottom up: each imports only packages below it (and itself), in any
# function as at the top. Modules at the package's root are listed as packages.
LAYERS = [("files", "backend", "algorithms", "parallel", "run_folder"), ("spec",), ("world",), ("data",), ("plan",),
          ("rewards",), ("envs",), ("models",), ("weights",), ("engine",), ("cluster",), ("rollout",), ("trainers",),
          ("doctor", "driver", "plot"), ("cli",)]


def test_no_package_imports_one_above_it():
    level = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert {p.stem if p.parent == PKG else p.relative_to(PKG).parts[0] for p in PKG.rglob("*.py")} - {"__init__"} \
        == set(level), "a package or root module is missing from LAYERS"
    upward = []
    for path in PKG.rglob("*.py"):
        if path.parent == PKG and path.stem == "__init__":
            continue
        mine = path.stem if path.parent == PKG else path.relative_to(PKG).parts[0]
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == "elasticrl" and len(parts) > 1 and level[parts[1]] > level[mine]:
                upward.append(f"{path.relative_to(ROOT)} imports {module}")
    assert upward == [], upward


def test_the_launch_glue_sits_on_the_components_and_the_package_on_neither():
    """``components`` (TorchX's entry point, holding the launch defaults) import nothing of
    ``launch``, which builds its apps from them; below the cli, the package imports neither."""
    def tops(path: Path) -> set[str]:
        return {m.split(".")[0] for m in _imports(path)}

    assert [p.name for p in (ROOT / "components").rglob("*.py") if "launch" in tops(p)] == []
    assert [p.name for p in (ROOT / "launch").rglob("*.py") if "elasticrl.cli" in _imports(p)] == []
    below_cli = [p for p in PKG.rglob("*.py") if p.name != "cli.py"]
    assert [str(p.relative_to(ROOT)) for p in below_cli if tops(p) & {"launch", "components"}] == []


def test_only_the_backend_touches_the_device_api():
    offenders = [str(p.relative_to(ROOT)) for p in TREE if p != DEVICE_MODULE and "torch.cuda" in p.read_text()]
    assert offenders == [], f"ask elasticrl.backend instead: {offenders}"


def test_algorithms_are_pure_tensor_math():
    banned = ("ray", "deepspeed", "vllm", "torch.distributed", "elasticrl.")
    for path in (PKG / "algorithms").rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(banned) and not m.startswith("elasticrl.algorithms")]
        assert not bad, f"{path.name} imports {bad}"


def test_nothing_imports_the_cli():
    for path in TREE:
        if path.name != "cli.py":
            assert "elasticrl.cli" not in _imports(path), path


def test_the_planner_is_arithmetic_on_the_spec():
    """`elasticrl plan` must answer in well under a second on a laptop: no distributed stack."""
    banned = ("ray", "deepspeed", "vllm", "torch", "transformers", "elasticrl.cluster", "elasticrl.engine",
              "elasticrl.trainers", "elasticrl.world.model", "elasticrl.world.tokenizer")
    for path in (PKG / "plan").rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(banned)]
        assert not bad, f"{path.name} imports {bad}"


def test_trainers_place_roles_through_the_cluster_layer():
    """Only elasticrl.cluster builds Ray placement groups; the rewards know nothing of Ray."""
    for path in TREE:
        if "placement_group" in path.read_text() and path.parent.name != "cluster":
            pytest.fail(f"{path.relative_to(ROOT)} builds placement groups; ask elasticrl.cluster.Placement")
    for path in (PKG / "rewards").rglob("*.py"):
        assert not [m for m in _imports(path) if m.startswith(("ray", "elasticrl.cluster"))], path


def _loaded_after(code: str) -> list[str]:
    """Heavy modules in sys.modules after running ``code`` in a fresh interpreter."""
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(m for m in ('torch', 'ray', 'deepspeed', 'vllm', " \
                   "'transformers') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("what, code, allowed", [
    ("planning the tiny job and a 7B job", "from elasticrl.plan import Inventory, plan_job\n"
     "from elasticrl.spec import load_spec\n"
     "plan_job(load_spec('examples/tiny_grpo.yaml'), Inventory(2, 8))\n"
     "plan_job(load_spec('examples/ppo_7b.yaml', check_paths=False), Inventory(4, 24))", []),
    ("validating a spec", "from elasticrl.spec import load_spec, describe\nload_spec('examples/tiny_ppo.yaml')\n"
     "describe()", []),
    ("building a launch dry-run's app", "from launch import submit\nfrom elasticrl.spec import load_spec\n"
     "from elasticrl.plan.apps import app_role_sizes\nspec = load_spec('examples/tiny_grpo.yaml')\n"
     "submit.build_app('examples/tiny_grpo.yaml', 'runs/x', [], app_role_sizes(spec), 'slurm', None)", []),
    ("the RL math", "import elasticrl.algorithms.advantages, elasticrl.algorithms.losses, elasticrl.algorithms.kl, "
     "elasticrl.algorithms.preference, elasticrl.algorithms.normalize", ["torch"]),
], ids=["plan", "spec", "launch", "algorithms"])
def test_what_a_layer_loads(what, code, allowed):
    assert _loaded_after(code) == allowed, what


def test_no_code_branches_on_an_algorithm_name_outside_the_algorithm_table():
    """What sets an algorithm apart is a field of its row (``spec.algorithms``), which the code asks."""
    import re

    branch = re.compile(r"algorithm\s*(==|!=|in\s*[(\[{]|not\s+in\b)")
    table = PKG / "spec" / "algorithms.py"
    found = [f"{p.relative_to(ROOT)}:{i}" for p in TREE if p != table
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert found == [], found


def test_the_algorithm_table_is_what_the_code_registers():
    from elasticrl.algorithms.advantages import ADVANTAGES
    from elasticrl.spec.algorithms import ADVANTAGE_ESTIMATORS, ALGORITHMS

    assert sorted(ADVANTAGES) == sorted(ADVANTAGE_ESTIMATORS)
    for name, alg in ALGORITHMS.items():
        module, _, fn = alg.trainer.partition(":")
        # a trainer is a module-level function of (spec, output); the import must not need Ray to start
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert f"\ndef {fn}(spec: JobSpec, output: Path) -> dict:" in source, (name, alg.trainer)
        assert alg.family != "rl" or alg.advantage in ADVANTAGE_ESTIMATORS, name
