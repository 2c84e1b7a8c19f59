# The README's two commands are `make demo` and `make test`; both set up everything they need.
.PHONY: demo test test-fast setup cluster-up cluster-down crd bench

demo:
	scripts/demo.sh

test:
	scripts/test.sh

# The inner loop: lint, contracts, CRD and the tests that need no cluster and no Ray (a few minutes).
test-fast:
	scripts/test-fast.sh

setup:
	scripts/bootstrap.sh

cluster-up: setup
	@PYTHONPATH=tests .venv/bin/python -m testenv up

cluster-down:
	@PYTHONPATH=tests .venv/bin/python -m testenv down

crd:
	.venv/bin/rljob crd

bench: setup
	.venv/bin/python bench/dp_balance.py
	.venv/bin/python bench/estimator.py
	.venv/bin/python bench/adaptive.py
	.venv/bin/python bench/weight_sync.py
	.venv/bin/python bench/pipeline.py
