#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, lint, architecture contracts, then pytest
# (unit, integration on the real local control plane, trainer tests on CPU).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
echo "==> ruff" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "==> import contracts" >&2
.venv/bin/lint-imports
echo "==> CRD is generated from the API models" >&2
.venv/bin/rljob crd --check
echo "==> docs build strictly (broken links, anchors, pages left out of the nav)" >&2
.venv/bin/mkdocs build --strict --quiet
echo "==> pytest" >&2
# Two xdist workers, each with its own control plane on free ports. The slowest modules come first
# (tests/conftest.py) and an idle worker steals queued tests from the other (--dist worksteal), so
# neither starts a job run of minutes while the other has nothing left; the slowest are listed.
exec .venv/bin/python -m pytest -n "${RLJOB_TEST_WORKERS:-2}" --dist worksteal --durations=25 "$@"
