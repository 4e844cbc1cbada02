"""`marl ... --help` for every command and subcommand: a usage line and a description.

The commands are discovered from the help itself (the `{a,b,...}` choices of each usage
line), so a command added later is checked without editing this file. In-process and
fast: --help exits before any command runs.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from flows.cli import main


def help_text(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0, f"marl {' '.join(args)} --help exited {exit_info.value.code}"
    return out.getvalue()


def subcommands(text: str) -> list[str]:
    """The choices of the usage line's `{a,b,c} ...` group, if the command has subcommands."""
    usage = text.split("\n\n", 1)[0]
    group = re.search(r"\{([\w,-]+)\}\s+\.\.\.", usage)  # a subparsers group, not an option's choices
    return group.group(1).split(",") if group else []


def all_commands() -> list[list[str]]:
    found, todo = [], [[]]
    while todo:
        args = todo.pop(0)
        found.append(args)
        assert len(args) < 4, f"runaway command discovery: {args}"
        todo += [[*args, name] for name in subcommands(help_text(args))]
    return found


def test_every_command_has_usage_and_description():
    commands = all_commands()
    names = {" ".join(c) for c in commands}
    # the surfaces of the README; discovery must at least find these
    assert {"train", "presets", "benchmark", "stack up", "stack down", "stack status",
            "replay info", "replay episodes"} <= names, names
    for args in commands:
        text = help_text(args)
        blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
        label = " ".join(["marl", *args])
        assert blocks[0].startswith(f"usage: {label}"), f"{label} --help: no usage line:\n{text}"
        assert len(blocks) > 1 and not blocks[1].startswith(("positional arguments:", "options:")), \
            f"{label} --help has no description:\n{text}"
        # every option and positional says what it is for
        lines = text.splitlines() + [""]
        undocumented = [line.strip() for line, after in zip(lines, lines[1:])
                        if re.fullmatch(r"  -{1,2}[\w-]+(?: \S+)*", line)  # an option, no help after it
                        and not re.match(r" {6,}\S", after)]  # nor on the next line
        assert not undocumented, f"{label} --help: no help for {undocumented}"
