"""Membership-inference audits per privacy group and empirical ε lower bounds (``idpsgd audit``).

* :mod:`.bounds` — ε lower bounds from TPR/FPR with Clopper–Pearson intervals; the one-run bound
  of Steinke, Nasr & Jagielski 2023; ROC statistics; tests between groups (numpy/scipy only).
* :mod:`.lira` — LiRA online/offline with fixed or per-example variance (Carlini et al. 2022) and
  the loss-threshold baseline, on score matrices (numpy only).
* :mod:`.shadows` — training the audit's models through the project's harness; checkpoints.
* :mod:`.runner` — :func:`run_audit` (LiRA, loss, one-run) per privacy group.
* :mod:`.report` — ``audit.json``, ``audit_scores.csv``, ``roc_by_group.png`` and the text.
* language models: :mod:`.canaries` (secret canaries per group, numpy), :mod:`.exposure`
  (Carlini et al.'s exposure, exact or estimated, numpy/scipy), :mod:`.lm` (scoring a model, the
  per-group audit), :mod:`.lm_training` (``idpsgd audit --model DIR --data FILE``, the Trainer path),
  :mod:`.lm_report` (its files and figure).
"""

from .bounds import (
    clopper_pearson,
    epsilon_from_counts,
    one_run_audit,
    one_run_epsilon,
    one_run_p_value,
)
from .runner import ATTACKS, AuditOptions, run_audit

__all__ = [
    "ATTACKS",
    "AuditOptions",
    "clopper_pearson",
    "epsilon_from_counts",
    "one_run_audit",
    "one_run_epsilon",
    "one_run_p_value",
    "run_audit",
]
