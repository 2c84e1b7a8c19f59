"""One reconcile of one RLJob: the fixed list of steps, their shared context and state, and the status.

`steps.reconcile_job` runs `steps.STEPS` in order (Kueue, preemption and gang steps live in
`queue_steps`), each step observing, asking `rljob_operator.decide` what to do and doing it through
`rljob_operator.kube`; `status.compute_status` turns what they observed into the status, written once.
"""
