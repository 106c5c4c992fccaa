"""Autotune: choosing the engine's knobs (fusion threshold, cycle time, ...) from measured
throughput while a job runs (``autotune``), the search over candidate settings
(``autotune_search``) and its Bayesian optimiser (``bayesopt``). It may import
:mod:`hora.core.op` and the base layer only; the engine owns it and tells it what it measured.
"""
