#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, lint, architecture contracts, then pytest
# (unit, integration on the real local control plane, trainer tests on CPU).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# The Kueue manager too (built once from Go modules, then cached): built here rather than inside the
# Kueue tests, where a first build would run beside the other worker's tests.
echo "==> Kueue manager (built once from Go modules, then cached)" >&2
PYTHONPATH=tests .venv/bin/python -m testenv build --kueue >&2
scripts/lint.sh
echo "==> pytest" >&2
# Two xdist workers, each with its own control plane on free ports. Each starts on its share of the
# slowest modules (tests/conftest.py) and an idle worker steals queued tests from the other (--dist
# worksteal), so neither starts a job run of minutes while the other has nothing left; the slowest
# are listed.
exec .venv/bin/python -m pytest -n "${RLJOB_TEST_WORKERS:-2}" --dist worksteal --durations=25 "$@"
