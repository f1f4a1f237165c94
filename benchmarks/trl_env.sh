#!/usr/bin/env bash
# TRL for the side-by-side benchmark (benchmarks/rl_step.py), in an environment of its own:
# benchmarks/.trl-venv, never the product's .venv. The CPU torch goes in first (the same
# constraints as the product's install), so nothing can pull a CUDA build; transformers is
# pinned to the product's version so both sides load the same model folder the same way.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/benchmarks/.trl-venv"
if [[ ! -x "$root/.venv/bin/python" ]]; then
  echo "trl_env.sh: the product's .venv is missing (TRL takes its transformers version): run make install first" >&2
  exit 2
fi
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
flavour=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; fi
constraints="$root/scripts/constraints-$flavour.txt"
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q -c "$constraints")
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" "trl==1.16.0" "transformers==$("$root/.venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
"$venv/bin/python" -c "import torch, trl; assert '+cu' not in torch.__version__, torch.__version__; print('trl', trl.__version__, 'torch', torch.__version__)"
