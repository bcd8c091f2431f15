"""Paper experiments: each paper's headline table or figure as a library function, registered for
``idpsgd reproduce NAME`` (:mod:`.registry`).

* ``heo-table1`` — Heo et al. (PDP-SGD), Table 1, Fig. 4, Fig. 5 (:mod:`.heo`).
* ``boenisch-table2``, ``boenisch-table3`` — Boenisch et al. (IDP-SGD), Table 2 and Table 3 (:mod:`.boenisch`).
* ``yu-figure`` — Yu et al. (individual privacy accounting), Figs. 1, 2/6, 4, 5 (:mod:`.yu`).
* ``thudi-figure1`` — Thudi et al. (per-instance DP of DP-SGD), Fig. 1a–1c (:mod:`.thudi`).
* ``user-level`` — user-level DP, ELS vs ULS (:mod:`.user_level`).
* ``lm-canaries`` — canary exposure and empirical ε per budget group of a fine-tuned GPT-2 (:mod:`.lm_canaries`).

Each module registers its experiments when imported; :func:`load` imports them all (torch is
imported only when an experiment runs).
"""

from __future__ import annotations

import importlib

from .registry import EXPERIMENTS, Experiment, Option, register

#: modules under idpsgd.experiments that register experiments (in the order of ``idpsgd reproduce --help``)
MODULES = ["heo", "boenisch", "yu", "thudi", "user_level", "lm_canaries"]


def load() -> dict:
    """Import every experiment module; returns :data:`EXPERIMENTS` (name -> :class:`Experiment`)."""
    for name in MODULES:
        importlib.import_module(f".{name}", __name__)
    return EXPERIMENTS


__all__ = ["EXPERIMENTS", "MODULES", "Experiment", "Option", "load", "register"]
