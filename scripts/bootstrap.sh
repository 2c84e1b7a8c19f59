#!/usr/bin/env bash
# Set up everything rljob needs on a fresh machine, idempotently:
#   .venv/ at the repository root with the rljob distribution (operator, trainer, dev extras), every
#   package at the version trainer_image/locks/test.txt pins (hash-checked): the CUDA image's lock's
#   versions wherever the two share a package (torch, transformers, peft, ray; `make lock`),
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
want=$(cat pyproject.toml "$lock" | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing $lock, then rljob[operator,trainer,tracking,dev] into .venv" >&2
  .venv/bin/uv pip install --quiet --python .venv/bin/python --require-hashes -r "$lock"
  # The dependencies are all in the lock: a package missing from it is an error, not a new download.
  .venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps -e .
  .venv/bin/uv pip check --python .venv/bin/python >&2 || {
    echo "bootstrap: .venv holds packages from before the lock that conflict with it:" \
      "rm -rf .venv && make setup" >&2
    exit 1
  }
  echo "$want" > "$stamp"
fi

if ! command -v go >/dev/null 2>&1; then
  echo "bootstrap: Go is needed to build the local control plane (kube-apiserver, etcd, ...)" >&2
  exit 1
fi
echo "==> control plane binaries (built once from Go modules, then cached)" >&2
PYTHONPATH=tests .venv/bin/python -m testenv build >&2
