"""The Kubernetes edge: the API adapter, credentials, leader election, watch-driven resync, metrics.

Everything that issues requests or serves the operator's own endpoints lives here: `adapter.Kube`
(the only caller of the API), `kubeclient` (where credentials come from), `leader` (Lease
election), `resync` (when a job is due again: pure), `metrics` (Prometheus). The pure core below
(`decide`, `builders`, `estimator`, `api`) never imports it.
"""
