"""The accounting commands' JSON contract and their one-line errors (exit code 2)."""
import json
import subprocess
import sys

import pytest

from idpsgd.accounting import epsilon_sgm
from idpsgd.cli import main


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_epsilon_json(capsys):
    out = run_json(capsys, "epsilon", "--sample-rate", "0.01", "--noise-multiplier", "1.1",
                   "--steps", "1000", "--delta", "1e-5")
    assert set(out) == {"epsilon", "delta", "accountant", "order"}
    assert out["epsilon"] == pytest.approx(float(epsilon_sgm(0.01, 1.1, 1000, 1e-5)))
    assert out["accountant"] == "rdp" and out["delta"] == 1e-5
    pld = run_json(capsys, "epsilon", "--sample-rate", "0.01", "--noise-multiplier", "1.1",
                   "--steps", "1000", "--delta", "1e-5", "--accountant", "pld")
    assert set(pld) == {"epsilon", "delta", "accountant"} and pld["epsilon"] < out["epsilon"]


def test_noise_multiplier_json(capsys):
    out = run_json(capsys, "noise-multiplier", "--epsilon", "2", "--delta", "1e-5",
                   "--sample-rate", "0.01", "--steps", "1000")
    assert set(out) == {"noise_multiplier", "epsilon", "accountant"}
    assert 2 * (1 - 1e-4) <= out["epsilon"] <= 2


@pytest.mark.parametrize("argv,needle", [
    (["epsilon", "--sample-rate", "1.5", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"],
     "--sample-rate=1.5 is invalid: must be in (0, 1]"),
    (["epsilon", "--sample-rate", "0.1", "--noise-multiplier", "0", "--steps", "10", "--delta", "1e-5"],
     "--noise-multiplier=0.0 is invalid"),
    (["epsilon", "--sample-rate", "0.1", "--noise-multiplier", "1", "--steps", "0", "--delta", "1e-5"],
     "--steps=0 is invalid"),
    (["epsilon", "--sample-rate", "0.1", "--noise-multiplier", "1", "--steps", "10", "--delta", "1"],
     "--delta=1.0 is invalid: must be in (0, 1)"),
    (["noise-multiplier", "--epsilon", "0", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"],
     "--epsilon=0.0 is invalid"),
    (["noise-multiplier", "--epsilon", "1e6", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"],
     "unreachable"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "idpsgd", "epsilon", "--sample-rate", "0.01",
                          "--noise-multiplier", "1.0", "--steps", "10", "--delta", "1e-5", "--json"],
                         capture_output=True, text=True, check=True)
    assert "epsilon" in json.loads(res.stdout)
