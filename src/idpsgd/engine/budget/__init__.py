"""Steps 5 and 6, charge the budget and filter: the ledger charged after every noise draw, and the
filters asked before the next.

``accountant.py`` — the per-group ledger (ε by the run's accountant); ``group_filter.py`` — every group
within its budget; ``filter.py`` — the individual Rényi filter (Feldman & Zrnic 2021); ``individual.py``
and ``sensitivity_check.py`` — individual accounting (Yu et al. 2023); ``journal.py`` — the run folder's
journal of drawn steps (an abandoned attempt's draws are charged too).
"""
