"""``fleets``: time to the target on heterogeneous, unreliable fleets (``python -m benchmarks fleets``).

Modules: ``protocol`` (the scenarios, rows, rate grids, seeds and budget, and why), ``cells``
(one row in one scenario: its rate tuned, its reported seeds, or its path's refusal),
``report`` (the verdicts, tables and "which algorithm for which fleet" paragraph, and the
results page's section) and ``__main__`` (the command and its raw file).
"""
