"""Node-pool defaults: what the Helm chart's `pools` values give RLJobs that do not say it themselves.

Role: the chart renders `pools` and `defaultPool` (values-nvidia.yaml, values-ascend.yaml) into a
ConfigMap (key `pools.json`) that the operator reads; `parse_pool_catalog` validates it,
`select_pool` picks a job's pool (`spec.pool`, else the first pool whose `acceleratorKinds` include
the job's accelerator kind, else `defaultPool`), and `apply_pool_defaults` fills in what the spec
left at its default: the trainer image (only while `spec.image.trainer` is the stock image the CRD
defaults to), each role's nodeSelector, tolerations and priorityClassName (when empty), the
accelerator's catalog numbers (`resources.accelerator.custom`, when unset), per-pod cpu and
memory (when unset) and extra resources such as hugepages or RDMA devices (pool's keys under the
spec's). Pure; called by
`rljob_operator.handlers` right after the spec is parsed, so planning and builders see the result.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from rljob_operator import api, errors

POOLS_KEY = "pools.json"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class PoolDefaults(_Model):
    """One pool's defaults (the chart's `pools.<name>`)."""

    accelerator_kinds: list[api.AcceleratorKind] = Field(
        default_factory=list,
        description="Jobs of these accelerator kinds get this pool unless spec.pool says.",
    )
    trainer_image: str | None = Field(None, min_length=1, description="Trainer image of this pool's jobs.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[api.Toleration] = Field(default_factory=list)
    priority_class_name: str | None = Field(None, min_length=1)
    devices: dict[str, api.CustomAcceleratorSpec] = Field(
        default_factory=dict, description="Device catalog additions: accelerator model -> numbers."
    )
    extra_resources: dict[str, api.Quantity] = Field(default_factory=dict)
    cpu: api.Quantity | None = Field(None, description="Per-pod CPU when the spec sets none.")
    memory: api.Quantity | None = Field(
        None, description="Per-pod memory when the spec sets none (hugepages need a memory request)."
    )


class PoolCatalog(_Model):
    """Every pool the operator knows (empty when the chart configures none)."""

    pools: dict[str, PoolDefaults] = Field(default_factory=dict)
    default_pool: str | None = Field(None, description="Pool of jobs no other rule assigns.")


def parse_pool_catalog(text: str | None) -> PoolCatalog:
    """Validate `pools.json`; empty means no pools. Raises ValueError naming the bad value."""
    if not text:
        return PoolCatalog()
    try:
        catalog = PoolCatalog.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise ValueError(
            f"the operator's {POOLS_KEY} (Helm values pools/defaultPool) is invalid: {exc}"
        ) from exc
    if catalog.default_pool and catalog.default_pool not in catalog.pools:
        raise ValueError(
            f"defaultPool {catalog.default_pool!r} is not one of pools ({', '.join(catalog.pools) or 'none'})"
        )
    return catalog


def select_pool(catalog: PoolCatalog, spec: api.RLJobSpec) -> tuple[str, PoolDefaults] | None:
    """The job's pool, or None. Raises `errors.InvalidSpecError` for an unknown `spec.pool`."""
    if spec.pool is not None:
        pool = catalog.pools.get(spec.pool)
        if pool is None:
            known = ", ".join(catalog.pools) or "none are configured"
            raise errors.InvalidSpecError(
                "spec.pool",
                f"pool {spec.pool!r} is not one of the operator's node pools ({known}): fix spec.pool, "
                f"or add pools.{spec.pool} to the rljob Helm release's values",
            )
        return spec.pool, pool
    kind = spec.resources.accelerator.kind
    for name, pool in catalog.pools.items():
        if kind in pool.accelerator_kinds:
            return name, pool
    if catalog.default_pool:
        return catalog.default_pool, catalog.pools[catalog.default_pool]
    return None


def _node_pool(own: api.NodePoolSpec, pool: PoolDefaults) -> api.NodePoolSpec:
    update: dict[str, object] = {}
    if not own.node_selector and pool.node_selector:
        update["node_selector"] = dict(pool.node_selector)
    if not own.tolerations and pool.tolerations:
        update["tolerations"] = list(pool.tolerations)
    if own.priority_class_name is None and pool.priority_class_name:
        update["priority_class_name"] = pool.priority_class_name
    return own.model_copy(update=update) if update else own


def apply_pool_defaults(spec: api.RLJobSpec, pool: PoolDefaults) -> api.RLJobSpec:
    """`spec` with `pool`'s defaults wherever the spec kept its own default (a new object)."""
    update: dict[str, object] = {
        "trainer_pool": _node_pool(spec.trainer_pool, pool),
        "rollout_pool": _node_pool(spec.rollout_pool, pool),
    }
    if pool.trainer_image and spec.image.trainer == api.DEFAULT_TRAINER_IMAGE:
        update["image"] = spec.image.model_copy(update={"trainer": pool.trainer_image})
    res = spec.resources
    res_update: dict[str, object] = {}
    acc = res.accelerator
    if acc.custom is None and acc.model is not None and acc.model in pool.devices:
        res_update["accelerator"] = acc.model_copy(update={"custom": pool.devices[acc.model]})
    if pool.extra_resources:
        res_update["extra_resources"] = {**pool.extra_resources, **res.extra_resources}
    if res.cpu is None and pool.cpu is not None:
        res_update["cpu"] = pool.cpu
    if res.memory is None and pool.memory is not None:
        res_update["memory"] = pool.memory
    if res_update:
        update["resources"] = res.model_copy(update=res_update)
    return spec.model_copy(update=update)


def with_pool_defaults(spec: api.RLJobSpec, catalog: PoolCatalog) -> api.RLJobSpec:
    """`select_pool` then `apply_pool_defaults`; `spec` unchanged when no pool applies."""
    chosen = select_pool(catalog, spec)
    return apply_pool_defaults(spec, chosen[1]) if chosen else spec
