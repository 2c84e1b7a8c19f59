"""The operator's decisions, pure: admission, preemption, pod lifecycle, elastic rollout, adaptive policy.

Each module takes observations and typed models and returns what to do; none talks to the cluster
(an import-linter contract forbids kopf and kubernetes here). `rljob_operator.reconcile` observes,
calls these, and makes the API calls they ask for.
"""
