"""Deprecated: renamed :mod:`idpsgd.training.individual_outputs` (removed in the next release).

Three modules were called ``individual.py``; this one writes a run's individual accounting outputs
(the per-example ε, summary and plots), and now says so.
"""

from __future__ import annotations

import warnings

from .individual_outputs import *  # noqa: F403  (the old module's public names, unchanged)

warnings.warn(
    "idpsgd.training.individual is renamed idpsgd.training.individual_outputs; the old name is removed "
    "in the next release",
    DeprecationWarning,
    stacklevel=2,
)
