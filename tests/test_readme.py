"""The README tells the truth about configuration and commands."""

from __future__ import annotations

from pathlib import Path

from grains.cli.config_doc import END, START, settings_table
from grains.cli.main import build_parser

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_configuration_table_matches_the_settings_model() -> None:
    section = README.split(START, 1)[1].split(END, 1)[0].strip()
    assert section == settings_table(), "run: python -m grains.cli.config_doc --write README.md"


def test_readme_gives_the_two_commands_first() -> None:
    head = README[: README.index("## Install")]
    assert "make demo" in head and "make test" in head


def test_every_cli_command_has_help_with_an_example() -> None:
    parser = build_parser()
    text = parser.format_help()
    for command in ("silo", "call", "status", "demo", "dashboard", "train", "drain", "jobs", "serve"):
        assert command in text, command
    assert "examples:" in text
