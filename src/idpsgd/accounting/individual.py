"""Deprecated: renamed :mod:`idpsgd.accounting.output_specific` (removed in the next release).

Three modules were called ``individual.py``; this one holds the output-specific individual
accounting of Yu et al. 2023, and now says so.  Import from the new module (or from
:mod:`idpsgd.accounting`, which re-exports its public names).
"""

from __future__ import annotations

import warnings

from .output_specific import *  # noqa: F403  (the old module's public names, unchanged)
from .output_specific import INDIVIDUAL_ACCOUNTANTS as INDIVIDUAL_ACCOUNTANTS

warnings.warn(
    "idpsgd.accounting.individual is renamed idpsgd.accounting.output_specific; the old name is removed "
    "in the next release",
    DeprecationWarning,
    stacklevel=2,
)
