"""RLJobs admitted by the real Kueue manager, reconciled by the real operator (issue 13 item 2).

The operator runs in-process (kopf) as its own ServiceAccount under `builders.rbac`'s ClusterRole;
Kueue (testenv.kueue: built from sigs.k8s.io/kueue, configured with
externalFrameworks ["RLJob.v1alpha1.rljob.io"]) runs as its own ServiceAccount. A labelled cpu
RLJob gets a Workload owned by it and no pod while the ClusterQueue is full (phase Queued, with
Kueue's reason); once the quota frees, Kueue admits the Workload, the pods appear with the
flavor's nodeLabels and tolerations and are bound by the real scheduler to the flavor's nodes, and
the Workload gets PodsReady=True from the operator. A job without the label in the same namespace
never waits for Kueue.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import yaml
from test_kueue import cpu_job_pods, cpu_rljob
from test_operator import _report, apply, condition, job_status, operator, pods, running_pods

from rljob_operator import builders
from rljob_operator.builders import workload
from testenv import kueue as kueue_env
from testenv.waiting import wait_for

pytestmark = pytest.mark.cluster

TAINT = {"key": "rljob.io/kueue-test", "value": "true", "effect": "NoSchedule"}


def delete_jobs_and_queues(cluster: Any, namespace: str, queues: list[dict[str, Any]]) -> None:
    """After a test: its RLJobs and their Workloads (waited for, so no quota stays reserved), then
    the test's ClusterQueue, LocalQueue and flavor."""
    cluster.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=true", check=False)
    cluster.kubectl("delete", "workloads", "--all", "-n", namespace, "--wait=true", check=False)
    cluster.kubectl("delete", "-f", "-", "--wait=false", input=yaml.safe_dump_all(queues), check=False)


def wl_condition(wl: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return next((c for c in ((wl or {}).get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def test_labelled_rljob_waits_queued_then_runs_on_the_flavor_nodes(
    cluster: Any,
    crd: None,
    kueue: kueue_env.Kueue,
    namespace: str,
    pool: Callable[..., str],
    operator_identity: str,
) -> None:
    # The flavor's nodes are tainted: only the flavor's tolerations let the pods there (and the
    # operator's pool capacity check, which knows no flavor, must not stop the job before Kueue).
    pool_name = pool(3, per_node=1, resource=None)
    cluster.kubectl(
        "taint", "nodes", "-l", f"pool={pool_name}", f"{TAINT['key']}={TAINT['value']}:NoSchedule"
    )
    plain_pool = pool(3, per_node=1, resource=None)
    flavor, cq = f"flavor-{namespace}"[:63], f"cq-{namespace}"[:63]
    queues = kueue_env.queue_manifests(
        namespace=namespace,
        flavor=flavor,
        cluster_queue=cq,
        local_queue="team-queue",
        quota={"cpu": "4", "memory": "8Gi"},  # one 3-cpu job at a time
        node_labels={"pool": pool_name},
    )
    queues[0]["spec"]["tolerations"] = [{**TAINT, "operator": "Equal"}]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(queues))
    try:
        wait_for(
            "the ClusterQueue to be Active",
            lambda: wl_condition(cluster.get_json("clusterqueue", cq), "Active").get("status") == "True",
        )
        # Fill the ClusterQueue with another 3-cpu Workload first.
        blocker = workload.build_workload(
            builders.JobRef("blocker", namespace),
            *cpu_job_pods(namespace, "blocker"),
            queue_name="team-queue",
        )
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(blocker))
        wait_for(
            "the blocker Workload admitted",
            lambda: (
                wl_condition(
                    cluster.get_json("workload", blocker["metadata"]["name"], namespace=namespace), "Admitted"
                ).get("status")
                == "True"
            ),
        )
        with operator(namespace):
            apply(cluster, namespace, cpu_rljob("queued", {"kueue.x-k8s.io/queue-name": "team-queue"}))
            plain_job = cpu_rljob("plain")
            plain_job["spec"]["trainerPool"] = {"nodeSelector": {"pool": plain_pool}}
            plain_job["spec"]["rolloutPool"] = {"nodeSelector": {"pool": plain_pool}}
            apply(cluster, namespace, plain_job)
            # The job without the label runs at once, Kueue or not.
            wait_for("the unlabelled job's 3 pods running", running_pods(cluster, namespace, "plain", 3))
            plain = wait_for(
                "the unlabelled job Running",
                lambda: (s := job_status(cluster, namespace, "plain")).get("phase") == "Running" and s,
            )
            assert "queue" not in plain
            assert condition(plain, "Admitted") == {}
            assert cluster.get_json("workload", "rljob-plain", namespace=namespace) is None

            st = wait_for(
                "the labelled job Queued with Kueue's reason",
                lambda: (
                    (s := job_status(cluster, namespace, "queued")).get("phase") == "Queued"
                    and "insufficient unused quota" in (s.get("queue") or {}).get("message", "")
                    and s
                ),
            )
            assert st["queue"]["name"] == "team-queue" and st["queue"]["workload"] == "rljob-queued"
            assert condition(st, "Admitted")["status"] == "False"
            assert condition(st, "Admitted")["reason"] == "Queued"
            assert condition(st, "Ready")["reason"] == "Queued"
            job = cluster.get_json("rljob", "queued", namespace=namespace, check=True)
            wl = cluster.get_json("workload", "rljob-queued", namespace=namespace, check=True)
            (ref,) = wl["metadata"]["ownerReferences"]
            assert (
                ref["uid"] == job["metadata"]["uid"] and ref["controller"] is True and ref["kind"] == "RLJob"
            )
            assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [
                ("trainer", 2),
                ("rollout", 1),
            ]
            assert wl_condition(wl, "QuotaReserved")["status"] == "False"
            assert pods(cluster, namespace, "queued") == []  # no pod before admission
            table = cluster.kubectl("get", "rljob", "queued", "-n", namespace, "-o", "wide").stdout
            assert "Queued" in table and "team-queue" in table

            cluster.kubectl("delete", "workload", blocker["metadata"]["name"], "-n", namespace)
            items = wait_for(
                "the admitted job's 3 pods running", running_pods(cluster, namespace, "queued", 3)
            )
            for p in items:
                assert p["spec"]["nodeSelector"] == {"pool": pool_name}  # the flavor's nodeLabels
                assert {**TAINT, "operator": "Equal"} in p["spec"]["tolerations"]
                assert p["spec"]["nodeName"].startswith(pool_name)  # bound there by the real scheduler
            wl = wait_for(
                "PodsReady=True on the Workload",
                lambda: (
                    (w := cluster.get_json("workload", "rljob-queued", namespace=namespace))
                    and wl_condition(w, "PodsReady").get("status") == "True"
                    and w
                ),
            )
            assert wl_condition(wl, "PodsReady")["reason"] == "Started"
            shown = cluster.kubectl(
                "get", "workload", "rljob-queued", "-n", namespace, "-o", "json", "--show-managed-fields"
            ).stdout
            fields = json.loads(shown)["metadata"]["managedFields"]
            managers = {f["manager"] for f in fields if f.get("subresource") == "status"}
            assert "rljob-operator-PodsReady" in managers
            st = wait_for(
                "the labelled job Running and Admitted",
                lambda: (s := job_status(cluster, namespace, "queued")).get("phase") == "Running" and s,
            )
            assert condition(st, "Admitted")["status"] == "True" and st["queue"]["flavors"] == [flavor]

            # The job ends: its Workload is Finished, and Kueue gives the quota back.
            cluster.succeed_pod(namespace, "queued-trainer-0")
            wl = wait_for(
                "Finished=True on the Workload",
                lambda: (
                    (w := cluster.get_json("workload", "rljob-queued", namespace=namespace))
                    and wl_condition(w, "Finished").get("status") == "True"
                    and w
                ),
            )
            assert wl_condition(wl, "Finished")["reason"] == "Succeeded"
            wait_for(
                "the ClusterQueue's quota released",
                lambda: (
                    (cluster.get_json("clusterqueue", cq) or {}).get("status", {}).get("reservingWorkloads")
                    == 0
                ),
            )
        # Kueue ran as its own ServiceAccount and lacked nothing for RLJobs.
        forbidden = [line for line in kueue.log().splitlines() if "forbidden" in line]
        assert forbidden == [], forbidden[:3]
    finally:
        delete_jobs_and_queues(cluster, namespace, queues)


def test_extra_engines_wait_for_quota_and_are_preempted_before_the_core(
    cluster: Any,
    crd: None,
    kueue: kueue_env.Kueue,
    namespace: str,
    pool: Callable[..., str],
    kubeconfig_env: None,
) -> None:
    """Adaptive mode adds a dedicated engine: its own Workload (priority one below the core's)
    waits while the quota holds only the core, its pod appears once the quota grows, and a
    higher-priority Workload makes Kueue preempt the extra engine, not the job's core: the rollout
    pod drains (status.rollout.drainingPods, a RolloutPodDraining Event) and goes within the
    bounded grace, its Workload with it, the trainer pods stay, the job never fails, and the engine
    queues again."""
    pool_name = pool(3, per_node=1, resource=None)
    flavor, cq = f"flavor-{namespace}"[:63], f"cq-{namespace}"[:63]
    queues = kueue_env.queue_manifests(
        namespace=namespace,
        flavor=flavor,
        cluster_queue=cq,
        local_queue="team-queue",
        quota={"cpu": "2", "memory": "4Gi"},  # the core's two trainer pods, nothing more
        node_labels={"pool": pool_name},
    )
    queues[1]["spec"]["preemption"] = {"withinClusterQueue": "LowerPriority"}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(queues))
    job = cpu_rljob("ada", {"kueue.x-k8s.io/queue-name": "team-queue"})
    job["spec"]["resources"].update(
        {
            "mode": "adaptive",
            "static": {"trainerAccelerators": 2, "rolloutAccelerators": 0},
            "adaptive": {
                "wakeAfterPressuredSyncPoints": 2,
                "scaleUpAfterPressuredSyncPoints": 2,
                "calmSyncPointsBeforeScaleDown": 2,
                "cooldownSeconds": 0,
            },
            # A preempted engine drains within min(drainGraceSeconds, checkpointGraceSeconds): 6 s.
            "rollout": {"tensorParallel": 1, "drainGraceSeconds": 300, "kind": "transformers"},
        }
    )
    job["spec"]["preemption"] = {"checkpointGraceSeconds": 6}
    step = 0

    def feed(shared_awake: int) -> None:
        nonlocal step
        reports = []
        for _ in range(2):
            step += 1
            reports.append(
                _report(step, time.time() + 1.5, pressured=True, shared_awake=shared_awake, dedicated=0)
            )
        patch = {"data": {"reports.json": json.dumps(reports)}}
        cluster.kubectl(
            "patch", "configmap", "ada-telemetry", "-n", namespace, "--type=merge", "-p", json.dumps(patch)
        )

    def rollout(key: str) -> Any:
        return (job_status(cluster, namespace, "ada").get("rollout") or {}).get(key)

    def live(role: str) -> list[str]:
        return [
            p["metadata"]["name"]
            for p in pods(cluster, namespace, "ada")
            if not p["metadata"].get("deletionTimestamp") and p["metadata"]["labels"]["rljob.io/role"] == role
        ]

    try:
        with operator(namespace):
            apply(cluster, namespace, job)
            wait_for("the core's trainer pods running", running_pods(cluster, namespace, "ada", 2))
            # Pressure wakes both shared engines (one per trainer pod), then adds a dedicated one.
            for awake in (0, 1):
                time.sleep(2)
                feed(shared_awake=awake)
                wait_for(f"wake {awake + 1}", lambda a=awake: rollout("desiredSharedAwake") == a + 1, 30)
            time.sleep(2)
            feed(shared_awake=2)
            wait_for("scale-up target", lambda: rollout("desiredDedicatedEngines") == 1, 30)
            extra = wait_for(
                "the extra engine's Workload, pending for quota",
                lambda: (
                    (w := cluster.get_json("workload", "rljob-ada-rollout-0", namespace=namespace))
                    and wl_condition(w, "QuotaReserved").get("status") == "False"
                    and w
                ),
            )
            core = cluster.get_json("workload", "rljob-ada", namespace=namespace, check=True)
            assert [(p["name"], p["count"]) for p in core["spec"]["podSets"]] == [("trainer", 2)]
            assert extra["spec"]["priority"] == core["spec"].get("priority", 0) - 1
            assert [(p["name"], p["count"]) for p in extra["spec"]["podSets"]] == [("rollout", 1)]
            assert extra["metadata"]["ownerReferences"][0]["name"] == "ada"
            time.sleep(3)
            assert live("rollout") == []  # quota bounds scale-up: no pod without admission

            # More quota: Kueue admits the engine, the operator creates its pod on the flavor's nodes.
            quota = "/spec/resourceGroups/0/flavors/0/resources"
            grow = [
                {"op": "replace", "path": f"{quota}/0/nominalQuota", "value": "3"},  # cpu
                {"op": "replace", "path": f"{quota}/1/nominalQuota", "value": "6Gi"},  # memory
            ]
            cluster.kubectl("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps(grow))
            wait_for("the extra engine's pod running", running_pods(cluster, namespace, "ada", 3))
            (engine_pod,) = [
                p for p in pods(cluster, namespace, "ada") if p["metadata"]["name"] == "ada-rollout-0"
            ]
            assert engine_pod["spec"]["nodeSelector"] == {"pool": pool_name}
            wait_for(
                "status counts the admitted extra engine",
                lambda: (
                    (s := job_status(cluster, namespace, "ada"))["queue"].get("extraEnginesAdmitted") == 1
                    and s
                ),
            )

            # A higher-priority Workload needing one cpu: Kueue preempts the extra engine, not the core.
            urgent = workload.build_workload(
                builders.JobRef("urgent", namespace),
                *cpu_job_pods(namespace, "urgent"),
                queue_name="team-queue",
            )
            urgent["spec"]["podSets"] = urgent["spec"]["podSets"][1:]  # one 1-cpu pod
            urgent["spec"]["priority"] = 1000
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(urgent))
            phases: list[str] = []

            def draining() -> Any:
                st = job_status(cluster, namespace, "ada")
                phases.append(st.get("phase", ""))
                drains = (st.get("rollout") or {}).get("drainingPods")
                return drains if drains and live("rollout") == ["ada-rollout-0"] else None

            # Kueue evicts the extra engine's Workload: the pod drains before it goes (the two-phase
            # scale-down). No driver runs here, so no release comes: the bounded grace deletes it.
            (drain,) = wait_for("the evicted engine's pod marked draining", draining, 30, interval_s=0.1)
            assert drain["index"] == 0
            since = datetime.fromisoformat(drain["since"].replace("Z", "+00:00")).timestamp()
            urgent_wl = cluster.get_json("workload", "rljob-urgent", namespace=namespace)
            assert wl_condition(urgent_wl, "Admitted").get("status") != "True"  # the quota is still held
            assert (
                wl_condition(
                    cluster.get_json("workload", "rljob-ada-rollout-0", namespace=namespace), "Evicted"
                ).get("status")
                == "True"
            )

            def engine_gone() -> bool:
                phases.append(job_status(cluster, namespace, "ada").get("phase", ""))
                return live("rollout") == []

            wait_for("the drained engine's pod deleted", engine_gone, 30, interval_s=0.1)
            assert time.time() - since >= 5, "deleted before the bounded drain grace (6 s)"
            assert time.time() - since < 60, "the drain grace was not bounded by checkpointGraceSeconds"
            # Its Workload goes with the pod: the quota is back, and Kueue admits the urgent one.
            wait_for(
                "the urgent Workload admitted",
                lambda: (
                    wl_condition(
                        cluster.get_json("workload", "rljob-urgent", namespace=namespace), "Admitted"
                    ).get("status")
                    == "True"
                ),
                60,
            )
            events = cluster.kubectl(
                "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=ada"
            ).stdout
            assert "Kueue evicted Workload rljob-ada-rollout-0" in events and "RolloutPodDraining" in events
            assert "RolloutPodDrained" in events
            assert "Failed" not in phases, phases  # no scale-down fails the job
            assert sorted(live("trainer")) == ["ada-trainer-0", "ada-trainer-1"]  # the core stays
            core = cluster.get_json("workload", "rljob-ada", namespace=namespace, check=True)
            assert wl_condition(core, "Admitted")["status"] == "True" and wl_condition(core, "Evicted") == {}
            # The policy still wants the engine: a new Workload queues it again.
            wait_for(
                "the engine queued again",
                lambda: (
                    wl_condition(
                        cluster.get_json("workload", "rljob-ada-rollout-0", namespace=namespace),
                        "QuotaReserved",
                    ).get("status")
                    == "False"
                ),
            )
            # The core runs on: Running with the pods it has (the engine waits for quota again).
            st = wait_for(
                "the job Running on its core",
                lambda: (s := job_status(cluster, namespace, "ada"))["phase"] == "Running" and s,
            )
            assert not st.get("failures") and not st.get("restarts") and not st.get("disruptions"), st

            # Suspended, the job holds no quota: its Workloads go, and resuming queues it again.
            suspend = {"spec": {"suspend": True}}
            cluster.kubectl(
                "patch", "rljob", "ada", "-n", namespace, "--type=merge", "-p", json.dumps(suspend)
            )
            wait_for(
                "the suspended job's Workloads gone",
                lambda: (
                    not [
                        w
                        for w in (cluster.get_json("workloads", namespace=namespace) or {}).get("items", [])
                        if w["metadata"]["labels"].get("rljob.io/job") == "ada"
                    ]
                ),
            )
            assert job_status(cluster, namespace, "ada")["phase"] == "Suspended"
            resume = {"spec": {"suspend": False}}
            cluster.kubectl(
                "patch", "rljob", "ada", "-n", namespace, "--type=merge", "-p", json.dumps(resume)
            )
            wait_for(
                "the resumed job's Workload back",
                lambda: cluster.get_json("workload", "rljob-ada", namespace=namespace) is not None,
            )
    finally:
        delete_jobs_and_queues(cluster, namespace, queues)


def test_a_spec_change_of_an_admitted_job_stops_it_and_rebuilds_its_workload(
    cluster: Any,
    crd: None,
    kueue: kueue_env.Kueue,
    namespace: str,
    pool: Callable[..., str],
    kubeconfig_env: None,
) -> None:
    """The user raises the rollout minimum of a running, admitted job: the admitted Workload no
    longer covers its pods, so (as Kueue's jobframework does) the operator stops the job, deletes
    the Workload once no pod is left, and creates one for the new spec; Kueue admits it and the job
    runs again with the new pods, never beyond the admitted quota and never Failed."""
    pool_name = pool(4, per_node=1, resource=None)
    flavor, cq = f"flavor-{namespace}"[:63], f"cq-{namespace}"[:63]
    queues = kueue_env.queue_manifests(
        namespace=namespace,
        flavor=flavor,
        cluster_queue=cq,
        local_queue="team-queue",
        quota={"cpu": "4", "memory": "8Gi"},
        node_labels={"pool": pool_name},
    )
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(queues))
    phases: list[str] = []

    def status_now() -> dict[str, Any]:
        st = job_status(cluster, namespace, "grow")
        phases.append(st.get("phase", ""))
        return st

    try:
        with operator(namespace):
            apply(cluster, namespace, cpu_rljob("grow", {"kueue.x-k8s.io/queue-name": "team-queue"}))
            first = wait_for("the admitted job's 3 pods running", running_pods(cluster, namespace, "grow", 3))
            old_uids = {p["metadata"]["uid"] for p in first}
            old_wl = cluster.get_json("workload", "rljob-grow", namespace=namespace, check=True)
            wait_for("the job Running", lambda: status_now().get("phase") == "Running")

            grow = {
                "spec": {
                    "resources": {
                        "totalAccelerators": 4,
                        "static": {"trainerAccelerators": 2, "rolloutAccelerators": 2},
                    }
                }
            }
            cluster.kubectl("patch", "rljob", "grow", "-n", namespace, "--type=merge", "-p", json.dumps(grow))

            live_counts: list[int] = []

            def rebuilt() -> dict[str, Any] | None:
                status_now()
                live = [
                    p for p in pods(cluster, namespace, "grow") if not p["metadata"].get("deletionTimestamp")
                ]
                wl = cluster.get_json("workload", "rljob-grow", namespace=namespace)
                fresh = wl and wl["metadata"]["uid"] != old_wl["metadata"]["uid"]
                if not fresh:
                    live_counts.append(len(live))
                return wl if fresh else None

            wl = wait_for("the Workload rebuilt for the new spec", rebuilt, 90)
            # (empty when the rebuild was done before the first look)
            assert max(live_counts, default=0) <= 3, "a pod the old admission does not cover was created"
            assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [
                ("trainer", 2),
                ("rollout", 2),
            ]
            assert wl["metadata"]["ownerReferences"][0]["name"] == "grow"
            items = wait_for(
                "the readmitted job's 4 pods running", running_pods(cluster, namespace, "grow", 4), 90
            )
            assert not old_uids & {p["metadata"]["uid"] for p in items}, "an old pod outlived its Workload"
            assert all(p["spec"]["nodeSelector"] == {"pool": pool_name} for p in items)
            st = wait_for(
                "the job Running again", lambda: (s := status_now()).get("phase") == "Running" and s
            )
            assert st["queue"]["admitted"] is True and not st.get("failures"), st
            assert "Failed" not in phases, phases
            events = cluster.kubectl(
                "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=grow"
            ).stdout
            assert "WorkloadOutOfSync" in events and "WorkloadRebuilt" in events

            # Deleted and applied again before anything collected the first job's Workload and
            # pods (--cascade=orphan: nothing ever will): the new job never runs under the earlier
            # job's admission; it deletes that Workload and queues one of its own.
            cluster.kubectl("delete", "rljob", "grow", "-n", namespace, "--cascade=orphan")
            wait_for("RLJob gone", lambda: cluster.get_json("rljob", "grow", namespace=namespace) is None, 60)
            earlier_wl = cluster.get_json("workload", "rljob-grow", namespace=namespace, check=True)
            apply(cluster, namespace, cpu_rljob("grow", {"kueue.x-k8s.io/queue-name": "team-queue"}))
            uid = cluster.get_json("rljob", "grow", namespace=namespace, check=True)["metadata"]["uid"]

            def orphans_named() -> list[str] | None:
                message = condition(job_status(cluster, namespace, "grow"), "Ready").get("message", "")
                if "have no owner" not in message:
                    return None
                return message.split("(kubectl delete -n ")[1].split(")")[0].split()

            cluster.kubectl("delete", "-n", *wait_for("the orphaned children named", orphans_named, 60))

            def own_workload() -> dict[str, Any] | None:
                wl = cluster.get_json("workload", "rljob-grow", namespace=namespace)
                refs = [r["uid"] for r in (wl or {}).get("metadata", {}).get("ownerReferences") or []]
                return wl if refs == [uid] else None

            mine = wait_for("the new job's own Workload", own_workload, 90)
            assert mine["metadata"]["uid"] != earlier_wl["metadata"]["uid"]
            again = wait_for("the new job's 3 pods running", running_pods(cluster, namespace, "grow", 3), 90)
            assert all([r["uid"] for r in p["metadata"]["ownerReferences"]] == [uid] for p in again)
            events = cluster.kubectl(
                "get", "events", "-n", namespace, "--field-selector", f"involvedObject.uid={uid}"
            ).stdout
            assert "EarlierJobLeftovers" in events, events
    finally:
        delete_jobs_and_queues(cluster, namespace, queues)
