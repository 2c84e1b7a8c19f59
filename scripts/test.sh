#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, lint, architecture contracts, then pytest
# (unit, integration on the real local control plane, trainer tests on CPU).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
echo "==> ruff" >&2
.venv/bin/ruff check .
echo "==> import contracts" >&2
.venv/bin/lint-imports
echo "==> CRD is generated from the API models" >&2
.venv/bin/rljob crd --check
echo "==> pytest" >&2
# Two xdist workers, each with its own control plane on free ports: the e2e jobs spend much of
# their time waiting on process start-up (the whole suite: 25–30 min measured on 2 cores; the slowest tests are listed at the end).
exec .venv/bin/python -m pytest -n "${RLJOB_TEST_WORKERS:-2}" --durations=25 "$@"
