"""Docs that cannot drift: docs/cli.md is what the CLI's --help says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
assert _spec and _spec.loader
cli_reference = importlib.util.module_from_spec(_spec)
sys.modules["cli_reference"] = cli_reference
_spec.loader.exec_module(cli_reference)


def test_the_cli_reference_is_what_every_help_says() -> None:
    written = (ROOT / "docs" / "cli.md").read_text()
    assert written == cli_reference.render(), (
        "docs/cli.md is not what the commands' --help prints; run `python scripts/cli_reference.py` and commit it")


def test_the_cli_reference_reaches_the_lazy_groups_subcommands() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    titles = [line[3:] for line in page.splitlines() if line.startswith("## ")]
    assert len(titles) == len(set(titles))
    assert {"llmgw", "llmgw ctl model plan", "llmgw ctl key create", "llmgw agent fault", "llmgw up"} <= set(titles)
