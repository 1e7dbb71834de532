"""Analysis of a sweep folder's records after the fact: energy attribution against per-GPU
counters (:mod:`~kvlab.analysis.attribution`), one plan measured by two executors
(:mod:`~kvlab.analysis.executors`) and the multi-GPU summary (:mod:`~kvlab.analysis.multigpu`)."""
