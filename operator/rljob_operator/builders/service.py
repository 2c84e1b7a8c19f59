"""The job's headless Service: stable DNS for `<job>-trainer-0.<job>.<ns>.svc` (the Ray head).

Pure builder; called by `rljob_operator.handlers`.
"""

from __future__ import annotations

from typing import Any

from rljob_operator import names
from rljob_operator.builders.common import JobRef
from rljob_trainer import config as trainer_config


def build_headless_service(job: JobRef) -> dict[str, Any]:
    """Headless Service selecting the job's trainer pods; publishes addresses before readiness so
    Ray workers can resolve the head while it starts."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names.service_name(job.name),
            "namespace": job.namespace,
            "labels": names.object_labels(job.name, names.ROLE_TRAINER),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_JOB: job.name, names.LABEL_ROLE: names.ROLE_TRAINER},
            "ports": [{"name": "ray-gcs", "port": trainer_config.DEFAULT_RAY_PORT, "protocol": "TCP"}],
        },
    }
