#!/usr/bin/env bash
# The checks before pytest, shared by `make test` (scripts/test.sh) and `make test-fast`
# (scripts/test-fast.sh): ruff, the import-layer contracts, CRD freshness and the strict docs build.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "==> ruff" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "==> import contracts" >&2
.venv/bin/lint-imports
echo "==> CRD is generated from the API models" >&2
.venv/bin/rljob crd --check
echo "==> docs build strictly (broken links, anchors, pages left out of the nav)" >&2
.venv/bin/mkdocs build --strict --quiet
