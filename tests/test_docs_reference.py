"""The documentation generated from the code is the code's: the command-line reference
(``docs/cli.md``) is what ``scripts/make_cli_reference.py`` makes of the parser now."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_the_cli_reference_is_generated_from_the_parser():
    script = REPO / "scripts" / "make_cli_reference.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    page = (REPO / "docs" / "cli.md").read_text()
    for flag in ("--algo", "--delay-model", "--chance-margin", "--resume", "--rtol"):
        assert f"`{flag}`" in page
