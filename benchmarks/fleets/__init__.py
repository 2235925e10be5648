"""``fleets``: time to the target on heterogeneous, unreliable fleets (``python -m benchmarks fleets``).

Modules: ``protocol`` (the scenarios, rows, rate grids, seeds and budget, and why), ``cells``
(one row in one scenario: its rate tuned, its reported seeds, or its path's refusal),
``verdicts`` (each row against its scenario's reference, in the results page's words),
``report`` (the detail tables, the "which algorithm for which fleet" paragraph, the raw files a
page shows and the detail page), ``compact`` (the results page's compact section) and
``__main__`` (the command and its raw file).
"""
