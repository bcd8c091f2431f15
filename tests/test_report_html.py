"""report.html is self-contained and renders in headless Chromium (skipped when Chromium is absent)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from idpsgd.cli import main
from support import file_mode

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert (
        main(
            [
                "train",
                "--method",
                "sample",
                "--budgets",
                "1,2,3",
                "--fractions",
                "0.34,0.43,0.23",
                "--epochs",
                "1",
                "--seed",
                "0",
                "--no-progress",
                "--individual-accounting",
                "--validate-subset",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_public_report_is_self_contained_and_has_no_private_section(run_dir):
    text = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "<h2>Guarantee</h2>" in text and "Individual privacy" in text and "data:image/png;base64," in text
    assert "Private: not covered" not in text
    assert "src='http" not in text and 'src="http' not in text and "<link" not in text  # nothing fetched


def test_private_report_is_mode_0600(run_dir, capsys):
    assert main(["report", str(run_dir), "--include-private"]) == 0
    path = run_dir / "private" / "report.html"
    assert file_mode(path) == 0o600
    assert "Private: not covered" in path.read_text(encoding="utf-8")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize("name", ["report.html", "private/report.html"])
def test_report_renders_in_headless_chromium(run_dir, tmp_path, name):
    if name.startswith("private"):
        assert main(["report", str(run_dir), "--include-private"]) == 0
    page = (run_dir / name).resolve().as_uri()
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and "<h2>Guarantee</h2>" in dom.stdout and "within budget" in dom.stdout
    subprocess.run(
        [CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1200,1600", page],
        capture_output=True,
        timeout=120,
        check=True,
    )
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not a blank one
