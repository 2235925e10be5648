"""Writes ``docs/cli.md``, the command line's reference, from the parser itself.

The ``train`` flags come from ``Config``'s field metadata (``pdasgd_jax.cli`` builds the parser
from it), so this page is generated, never copied: edit a field's help in ``config.py``, then
run ``python scripts/make_cli_reference.py``. ``--check`` exits with status 1 if the committed
page differs from what this script makes (``tests/test_docs_reference.py`` runs it).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from pdasgd_jax import cli

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "cli.md"
HEADER = """# Command-line reference

Generated from the parser (`python scripts/make_cli_reference.py`); the `train` flags are
`Config`'s fields, so `Config(batch_size=64)` in Python is `--batch-size 64` here. Exit
statuses of `train`: 0 the run trained; 2 bad input, refused before any work; 3 the run
failed (its `summary.json` says how: `non-finite`, `diverged`, `non-finite-eval`, `chance`);
1 an error during the work, with its traceback.
"""


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _flag_row(action: argparse.Action) -> str:
    flags = ", ".join(f"`{f}`" for f in action.option_strings)
    if action.choices:
        kind = " | ".join(f"`{c}`" for c in action.choices)
    elif isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        kind = "switch"
    else:
        kind = action.metavar or (action.type.__name__.upper() if action.type else "")
    default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
    return f"| {flags} | {_cell(kind)} | {default} | {_cell(action.help or '')} |"


def _command(name: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `{name}`", ""]
    if parser.description:
        lines += [parser.description, ""]
    for group in parser._action_groups:  # argparse keeps its groups here, in order
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        positionals = [a for a in group._group_actions if not a.option_strings]
        if not actions and not positionals:
            continue
        title = group.title if group.title not in ("options", "optional arguments") else "other"
        lines += [f"### {title}", "", "| flag | values | default | what it does |", "|---|---|---|---|"]
        lines += [f"| `{a.metavar or a.dest}` | positional | | {_cell(a.help or '')} |" for a in positionals]
        lines += [_flag_row(a) for a in actions] + [""]
    return lines


def render() -> str:
    """The page as the current parser describes it."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    lines = [HEADER]
    for name, sub in commands.items():
        lines += _command(name, sub)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is not what this makes")
    check = args.parse_args(argv).check
    page = render()
    if check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run python scripts/make_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
