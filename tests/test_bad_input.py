"""Every bad input over every command exits 2 with one line naming the flag and its value (issue 17).

The cases are data: :mod:`tests.bad_inputs` (``CASES``).  Each runs the CLI in-process; training is
replaced by a tripwire, so a case that would start training (a silent wrong run) fails at once
instead of training.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bad_inputs import BASE, CASES, make_files
from idpsgd.cli.main import build_parser, main
from idpsgd.cli.registry import COMMANDS

PARSER = build_parser()  # registers every command module; built once (main() reuses it below)
AVAILABLE = set(COMMANDS)


class TrainingStarted(Exception):
    """Raised by the tripwire: the command got as far as a training step."""


def _tripwire(*args, **kwargs):
    raise TrainingStarted


def _id(case) -> str:
    command, arguments, _ = case
    return re.sub(r"[^\w.=,:+-]+", "_", f"{command.lstrip('!') or 'idpsgd'} {arguments}")[:90]


def _argv(command: str, arguments: str, tmp: Path) -> list[str]:
    name = command.lstrip("!")
    fill = lambda s: s.replace("{tmp}", str(tmp))  # noqa: E731
    base = [] if command.startswith("!") else shlex.split(fill(BASE[name]))
    return ([name] if name else []) + base + shlex.split(fill(arguments))


def test_table_is_large_and_covers_every_command():
    assert len(CASES) >= 150
    assert len({(c, a) for c, a, _ in CASES}) == len(CASES), "duplicate cases"
    covered = {c.lstrip("!") for c, _, _ in CASES}
    assert covered >= AVAILABLE, f"commands without bad-input cases: {sorted(AVAILABLE - covered)}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    command, arguments, needle = case
    name = command.lstrip("!")
    if name and name not in AVAILABLE:
        pytest.skip(f"no command {name!r} (yet)")
    from idpsgd.training import loop, pdp

    monkeypatch.setattr(
        sys.modules["idpsgd.cli.main"], "build_parser", lambda: PARSER
    )  # speed: one parser for all cases
    monkeypatch.setattr(loop.Trainer, "_run_phase", _tripwire)
    monkeypatch.setattr(pdp, "run_dp_round", _tripwire)
    if name == "finetune":
        hf_trainer = pytest.importorskip("idpsgd.integrations.hf.trainer")
        monkeypatch.setattr(hf_trainer.IndividualizedTrainer, "train", _tripwire)
    marker = make_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # `--out ""` must not write into the repository
    argv = _argv(command, arguments, tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    except TrainingStarted:
        pytest.fail(f"idpsgd {shlex.join(argv)}: training started (a silent wrong run)")
    _out, err = capsys.readouterr()
    shown = f"idpsgd {shlex.join(argv)}\nexit {code}\nstderr: {err!r}"
    assert not marker.exists(), f"code from a crafted file ran:\n{shown}"
    assert code == 2, shown
    assert "Traceback" not in err, shown
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line:\n{shown}"
    assert needle.replace("{tmp}", str(tmp_path)).replace("'", "") in err.replace("'", ""), (
        f"expected {needle!r}:\n{shown}"
    )
