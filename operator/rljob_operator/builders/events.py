"""core/v1 Events about an RLJob (what `kubectl describe rljob` lists under Events).

Role: pure; the shell (`handlers`) collects a reconcile's Events and `adapter.Kube.create` posts them
after the status write. Posted directly rather than through `kopf.event`, whose queue exists only
inside kopf's own handler tasks (the resync loop is not one).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from rljob_operator import api, names

MAX_MESSAGE = 1024


def build_event(
    owner: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str, now: datetime
) -> dict[str, Any]:
    """An Event on `owner` (the RLJob as read from the API) at `now`."""
    meta = owner.get("metadata") or {}
    stamp = api.format_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name', 'rljob')}.", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": owner.get("apiVersion", api.API_VERSION),
            "kind": owner.get("kind", api.KIND),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": names.MANAGED_BY},
        "reportingComponent": names.MANAGED_BY,
        "reportingInstance": names.MANAGED_BY,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
