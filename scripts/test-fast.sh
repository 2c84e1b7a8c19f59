#!/usr/bin/env bash
# The inner loop (`make test-fast`): lint, architecture contracts, CRD freshness and every test that
# needs no cluster, no Ray and no minutes of training (markers cluster, ray, slow left out). What
# CI runs is `make test`: every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/lint.sh
echo "==> pytest (no cluster, no Ray, not slow)" >&2
exec .venv/bin/python -m pytest -n "${RLJOB_TEST_WORKERS:-2}" -m "not cluster and not ray and not slow" \
  --durations=10 "$@"
