"""What keeps one job's reconcile from hurting the others, or the API: planning's time limit, the
per-job backoff after API errors, and status writes on the version they were computed from.

Role: called by `steps` (and the resync loop in `handlers` for a failed status write). Each is a
small piece of the imperative shell; the decisions inside are pure (`resync.api_error_delay_s`,
`status.status_patch`). docs/security.md says what each defends against.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable
from typing import Any

from rljob_operator import api, errors
from rljob_operator.kube import adapter, resync
from rljob_operator.reconcile import status
from rljob_operator.reconcile.state import State

#: The longest one job's planning may take. The model config's sizes are bounded
#: (`api.MODEL_CONFIG_LIMITS`: a config at every bound plans in milliseconds), so this is the second
#: fence: planning runs in its own threads, never on the event loop every job shares, and a plan
#: past the limit fails its job's generation (`PlanningTimeout`) instead of stalling the others.
PLAN_TIMEOUT_S = float(os.environ.get("RLJOB_PLAN_TIMEOUT_S", "10"))
PLAN_THREADS = 2
_planner: list[concurrent.futures.ThreadPoolExecutor] = []


async def plan_off_loop(plan: Callable[[], api.PlanStatus]) -> api.PlanStatus:
    """`plan()` in the planner threads, within PLAN_TIMEOUT_S (a thread cannot be killed: one past
    the limit runs on, but its job no longer waits for it and the loop never did)."""
    if not _planner:
        _planner.append(concurrent.futures.ThreadPoolExecutor(PLAN_THREADS, thread_name_prefix="rljob-plan"))
    work = asyncio.get_running_loop().run_in_executor(_planner[0], plan)
    try:
        return await asyncio.wait_for(work, PLAN_TIMEOUT_S)
    except TimeoutError:
        raise errors.PlanningTimeoutError(
            "spec.model.config",
            f"planning took longer than {PLAN_TIMEOUT_S:g}s: check the config's sizes (layers, hidden "
            "size, experts) against the model's real config.json",
        ) from None


def api_backoff_s(state: State, key: str, exc: BaseException) -> float:
    """One more API error in a row for job `key`: its next reconcile's delay (5 s doubling to 5 min,
    jittered; a 429's Retry-After when longer: `resync.api_error_delay_s`). A reconcile the API
    answered resets the count (`steps.reconcile_job`)."""
    failures = state.api_failures[key] = state.api_failures.get(key, 0) + 1
    return resync.api_error_delay_s(failures, adapter.retry_after_s(exc))


async def write_status(
    kube: adapter.Kube, body: dict[str, Any], new: api.RLJobStatus, patch: dict[str, Any]
) -> dict[str, Any] | None:
    """Patch the status computed from `body`, only if the RLJob is still at `body`'s resourceVersion.

    A 409 Conflict means it changed since (a spec edit, another writer): the RLJob is read again
    and the same new status is written as a patch against what is stored now, once; a second
    conflict raises (the job's API backoff retries). Returns the RLJob as stored after the write,
    or None when it is gone."""
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    try:
        return await kube.patch_status(namespace, name, patch, meta.get("resourceVersion"))
    except Exception as exc:
        if not adapter.is_conflict(exc):
            raise
    fresh = await kube.read_rljob(namespace, name)
    if fresh is None:
        return None
    again = status.status_patch(dict(fresh.get("status") or {}), new)
    if again is None:
        return fresh
    return await kube.patch_status(
        namespace, name, again, (fresh.get("metadata") or {}).get("resourceVersion")
    )
