"""Run Opacus 1.6's own PrivacyEngine tests with idpsgd's engine swapped in (``make test-opacus``).

    python tests/opacus_suite/run.py               # idpsgd's IndividualizedPrivacyEngine
    python tests/opacus_suite/run.py --baseline    # Opacus's own PrivacyEngine (must pass everything)
    python tests/opacus_suite/run.py -- -k checkpoint -x     # extra pytest arguments after --

The test files ship in Opacus's wheel (``opacus/tests/``).  Prints per-test outcomes and the line
``opacus suite: N passed, N refused, N other, N skipped``; exits non-zero when a failure is not a
documented refusal (``idpsgd.engine.opacus_compat.REFUSALS``) nor on ``allowed_other.txt``.
Needs ``hypothesis``, ``pytest-timeout`` and ``torchvision`` (``make test-opacus`` installs them;
torchvision goes to ``--site``, outside the project's environment, see ``harness.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FILES = (
    "privacy_engine_test",
    "privacy_engine_validation_test",
    "randomness_test",
    "batch_memory_manager_test",
    "gradient_accumulation_test",
    "accounting_noise_multiplier_test",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", action="store_true", help="run Opacus's own PrivacyEngine instead of idpsgd's")
    parser.add_argument(
        "--site",
        default=str(ROOT / ".opacus-suite"),
        help="folder with torchvision (pip install --no-deps --target); default %(default)s",
    )
    parser.add_argument("--results", help="write every test's outcome and error as JSON to this file")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test (pytest-timeout)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    os.environ["IDPSGD_OPACUS_ENGINE"] = "opacus" if args.baseline else "idpsgd"
    if args.results:
        os.environ["IDPSGD_OPACUS_RESULTS"] = str(Path(args.results).resolve())
    if Path(args.site).is_dir():
        sys.path.insert(0, str(Path(args.site).resolve()))
    sys.path.insert(0, str(HERE))
    import pytest

    return int(
        pytest.main(
            [
                "-c",
                str(HERE / "pytest.ini"),
                "--rootdir",
                str(HERE),
                "-p",
                "harness",
                f"--timeout={args.timeout}",
                "--pyargs",
                *(f"opacus.tests.{f}" for f in FILES),
                *args.pytest_args,
            ]
        )
    )


if __name__ == "__main__":
    sys.exit(main())
