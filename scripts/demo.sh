#!/usr/bin/env bash
# The main job on the local embedded cluster, from a fresh clone:
#   1. set up .venv and the control plane binaries (scripts/bootstrap.sh),
#   2. bring up the local cluster (etcd, kube-apiserver, controller-manager, scheduler, fake
#      GPU/NPU/CPU nodes) and install the RLJob CRD,
#   3. print the estimator's plan of the example jobs,
#   4. run the operator, apply examples/tiny-cpu.yaml and show what it creates.
# The trainer pods are scheduled and bound for real, but the fake kubelet only marks them Running:
# no container runs on the local cluster yet (see README, "What works today").
# The cluster stays up afterwards; `make cluster-down` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh

export_line=$(PYTHONPATH=tests .venv/bin/python -m testenv up)
eval "$export_line"
kubectl() { "$(PYTHONPATH=tests .venv/bin/python -c 'from testenv import binaries; print(binaries.ensure_go_binaries() / "kubectl")')" "$@"; }

echo "==> nodes of the local cluster"
kubectl get nodes -L rljob.io/accelerator
echo "==> installing the RLJob CRD"
kubectl apply -f crds/
kubectl wait --for=condition=Established crd/rljobs.rljob.io --timeout=60s

for example in examples/qwen3.5-4b-gsm8k-adaptive.yaml examples/tiny-cpu.yaml; do
  echo "==> rljob plan -f $example"
  .venv/bin/rljob plan -f "$example"
done

mkdir -p .rljob
echo "==> starting the operator (log: .rljob/operator.log)"
.venv/bin/rljob operator --all-namespaces > .rljob/operator.log 2>&1 &
operator_pid=$!
trap 'kill $operator_pid 2>/dev/null || true' EXIT

kubectl apply -f examples/tiny-cpu.yaml
for _ in $(seq 1 60); do
  phase=$(kubectl get rljob tiny-cpu -o jsonpath='{.status.phase}' 2>/dev/null || true)
  [ "$phase" = "Running" ] && break
  sleep 1
done
echo "==> kubectl get rljobs"
kubectl get rljobs -o wide
echo "==> pods, services, configmaps and RBAC the operator created"
kubectl get pods,services,configmaps,serviceaccounts,roles,rolebindings -l rljob.io/job=tiny-cpu -o wide
echo "==> status.plan"
kubectl get rljob tiny-cpu -o jsonpath='{.status.plan}'; echo
echo
echo "The local cluster is still up. Use it with:"
echo "  $export_line"
echo "Stop it with: make cluster-down"
