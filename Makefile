# The README's two commands are `make demo` and `make test`; both set up everything they need.
.PHONY: demo test test-fast lint setup cluster-up cluster-down crd bench lock test-vllm audit

demo:
	scripts/demo.sh

test:
	scripts/test.sh

# The inner loop: lint, contracts, CRD and the tests that need no cluster and no Ray (a few minutes).
test-fast:
	scripts/test-fast.sh

# The checks both run before pytest: ruff, import contracts, CRD freshness, the strict docs build.
lint: setup
	scripts/lint.sh

setup:
	scripts/bootstrap.sh

cluster-up: setup
	@PYTHONPATH=tests .venv/bin/python -m testenv up

cluster-down:
	@if [ -f .rljob/operator.pid ]; then kill "$$(cat .rljob/operator.pid)" 2>/dev/null || true; rm -f .rljob/operator.pid; fi
	@PYTHONPATH=tests .venv/bin/python -m testenv down

crd:
	.venv/bin/rljob crd

# One lock per image and one for the tests (trainer_image/locks/); `scripts/lock.sh --check` in CI.
lock: setup
	scripts/lock.sh

# vLLM conformance tier: every vLLM call rljob makes, checked against the images' real vLLM releases.
test-vllm: setup
	scripts/test_vllm.sh

# Known vulnerabilities in the image locks and the test environment (trainer_image/locks/audit-allow.txt).
audit: setup
	scripts/audit.sh

bench: setup
	.venv/bin/python bench/dp_balance.py
	.venv/bin/python bench/estimator.py
	.venv/bin/python bench/adaptive.py
	.venv/bin/python bench/weight_sync.py
	.venv/bin/python bench/engine.py
	.venv/bin/python bench/pipeline.py
	.venv/bin/python bench/agents.py
	.venv/bin/python bench/reward_model.py
