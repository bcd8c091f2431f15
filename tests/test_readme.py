"""The README's library examples run as written (they are the new user's first contact)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(name: str) -> str:
    """The python block that follows ``<!-- readme-test: NAME -->`` in README.md."""
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"<!-- readme-test: {re.escape(name)} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"README.md has no python block tagged readme-test: {name}"
    return m.group(1)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bring_your_own_model_and_data():
    ns: dict = {}
    exec(compile(readme_block("byo"), "README.md:byo", "exec"), ns)
    engine, budgets = ns["engine"], ns["budgets"]
    eps = engine.get_epsilon().per_group
    values = np.unique(budgets.epsilons)
    assert engine.steps > 0
    assert eps.shape == values.shape and np.all(eps <= values + 1e-9) and np.all(eps > 0.5 * values)
    ind = np.asarray(ns["eps_i"])
    assert ind.shape == (len(budgets),) and np.all(ind <= budgets.epsilons + 1e-9)
