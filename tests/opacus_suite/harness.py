"""pytest plugin: Opacus 1.6's own ``PrivacyEngine`` tests with idpsgd's engine swapped in (issue 31).

Loaded by ``run.py`` (``-p harness``) — not a ``conftest.py``, so that the default ``pytest`` run of
``tests/`` never imports it.  At load, before any test module is imported, it

* sets ``opacus.PrivacyEngine`` and ``opacus.privacy_engine.PrivacyEngine`` to
  ``idpsgd.IndividualizedPrivacyEngine`` (``IDPSGD_OPACUS_ENGINE=opacus`` keeps Opacus's own: the
  baseline run, which must pass everything);
* makes ``torchvision`` importable beside the CPU build of torch (:func:`import_torchvision`);
* registers a hypothesis profile: derandomized, at most 10 examples per test, no deadline.

Every failed test is classified against :data:`idpsgd.engine.opacus_compat.REFUSALS`, the one
table of the options the engine refuses on purpose: a failure whose error is one of them counts
as **refused**, anything else as **other**.  The summary line reads
``opacus suite: N passed, N refused, N other, N skipped`` and the session fails when ``other``
exceeds the allow-list in ``allowed_other.txt`` (each entry a node id with its justification).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENGINE = os.environ.get("IDPSGD_OPACUS_ENGINE", "idpsgd")
if ENGINE not in ("idpsgd", "opacus"):
    raise SystemExit(f"IDPSGD_OPACUS_ENGINE={ENGINE!r} is invalid: must be idpsgd or opacus")


def import_torchvision():
    """Import torchvision; when its C extension cannot load beside this torch build (PyPI's
    torchvision is built against CUDA torch: ``operator torchvision::nms does not exist``), define
    the two operators its import registers fake kernels for, as Python-declared schemas with no
    implementation, and import again.  The Opacus tests use only torchvision's models,
    transforms and ``FakeData`` (pure Python); calling ``torchvision.ops.nms`` would still fail."""
    try:
        import torchvision

        return "native"
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import_torchvision.lib = lib  # keep the library (and its definitions) alive
    import torchvision  # noqa: F401

    return "without its C operators"


def _swap_engine() -> None:
    import opacus
    import opacus.privacy_engine

    from idpsgd import IndividualizedPrivacyEngine

    opacus.PrivacyEngine = IndividualizedPrivacyEngine
    opacus.privacy_engine.PrivacyEngine = IndividualizedPrivacyEngine


def _refusals():
    from idpsgd.engine.opacus_compat import REFUSALS

    return REFUSALS


def classify(crash: str) -> str | None:
    """The option of the refusal a failure's error line (``Type: message``) is, or None."""
    for refusal in _refusals():
        if refusal.matches(crash):
            return refusal.option
    return None


class Tally:
    def __init__(self):
        self.items: dict[str, dict] = {}

    def add(self, report) -> None:
        entry = self.items.setdefault(report.nodeid, {"outcome": "passed", "failures": []})
        if report.skipped and report.when in ("setup", "call") and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
        if report.failed:
            crash = (
                getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
                or str(report.longrepr).strip().splitlines()[-1]
            )
            crash = crash.strip()
            refusal = classify(crash) if ENGINE == "idpsgd" else None
            entry["failures"].append({"when": report.when, "refused": refusal, "error": crash[:400]})
            kinds = {"refused" if f["refused"] else "other" for f in entry["failures"]}
            entry["outcome"] = "other" if "other" in kinds else "refused"

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "refused": 0, "other": 0, "skipped": 0}
        for entry in self.items.values():
            out[entry["outcome"]] += 1
        return out


def _allowed_other() -> dict[str, str]:
    path = HERE / "allowed_other.txt"
    allowed = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                node, _, why = line.partition(" ")
                allowed[node] = why.strip()
    return allowed


TALLY = Tally()


def pytest_configure(config):
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "opacus-suite",
        derandomize=True,
        max_examples=10,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    settings.load_profile("opacus-suite")
    config.torchvision = import_torchvision()
    if ENGINE == "idpsgd":
        _swap_engine()


def pytest_report_header(config):
    return [f"opacus suite: engine={ENGINE}, torchvision {config.torchvision}"]


def pytest_runtest_logreport(report):
    TALLY.add(report)


def pytest_sessionfinish(session, exitstatus):
    counts = TALLY.counts()
    allowed = _allowed_other() if ENGINE == "idpsgd" else {}
    unexplained = [n for n, e in TALLY.items.items() if e["outcome"] == "other" and n not in allowed]
    session.config._opacus_suite = (counts, unexplained)
    out = os.environ.get("IDPSGD_OPACUS_RESULTS")
    if out:
        Path(out).write_text(
            json.dumps(
                {"engine": ENGINE, "counts": counts, "unexplained_other": unexplained, "tests": TALLY.items},
                indent=1,
                sort_keys=True,
            )
        )
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED if unexplained else pytest.ExitCode.OK


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts, unexplained = getattr(config, "_opacus_suite", (TALLY.counts(), []))
    tr = terminalreporter
    by_option: dict[str, int] = {}
    for entry in TALLY.items.values():
        if entry["outcome"] == "refused":
            for f in entry["failures"]:
                by_option[f["refused"]] = by_option.get(f["refused"], 0) + 1
    tr.section(f"opacus suite ({ENGINE})")
    for option, n in sorted(by_option.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"refused {n:4d}  {option}")
    for node in unexplained:
        errors = "; ".join(f["error"] for f in TALLY.items[node]["failures"] if not f["refused"])
        tr.write_line(f"OTHER  {node}: {errors[:300]}")
    tr.write_line(
        f"opacus suite: {counts['passed']} passed, {counts['refused']} refused, {counts['other']} other, "
        f"{counts['skipped']} skipped"
        + (f" ({len(unexplained)} not on the allow-list)" if counts["other"] != len(unexplained) else "")
    )
