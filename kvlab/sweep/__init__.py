"""The sweep: expand params into runs, warm up, measure, record; resumable and locked.

Its modules import one way, each only from those before it:
:mod:`~kvlab.sweep.params` (schema, method variants, loading) -> :mod:`~kvlab.sweep.checks`
(every check before a model loads) -> :mod:`~kvlab.sweep.plan` (runs, ids, block order, budget,
identity and failure records) -> :mod:`~kvlab.sweep.group` (the measured group of runs in one
process) -> :mod:`kvlab.runner` (executors) -> :mod:`~kvlab.sweep.lock` and
:mod:`~kvlab.sweep.driver` (manifest, status, quality pass, run_sweep) ->
:mod:`~kvlab.sweep.admission` (budgeted sweeps).

Nothing is imported here, so ``kvlab.sweep.params`` loads light (params validation never imports
torch).
"""
