"""The flag tables of docs/operations.md, generated from the parser (so they cannot drift).

    python -m tandem.flag_docs           # rewrite the tables between their markers
    python -m tandem.flag_docs --check   # exit 1 when they are stale (a unit test does this too)
"""

from __future__ import annotations

import argparse

from tandem.options import flag_actions


def flag_table(parser: argparse.ArgumentParser, commands: list[str]) -> str:
    """A Markdown table of the flags of `commands` (subcommands of `parser`, after
    `finish_parser`): one row per flag and default, naming the commands that take it."""
    subs = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs = action.choices
    rows: dict[tuple, list[str]] = {}
    for command in commands:
        for action in flag_actions(subs[command]):
            help_text, default, env = getattr(action, "doc", (action.help or "", "", None))
            flags = ", ".join(f"`{o}`" for o in sorted(action.option_strings, key=len, reverse=True))
            rows.setdefault((flags, default, env or "", help_text), []).append(command)
    lines = ["| flag | env | default | commands | meaning |", "|---|---|---|---|---|"]
    for (flags, default, env, help_text), cmds in rows.items():
        env_cell = f"`{env}`" if env else "—"
        meaning = help_text.replace("|", "\\|")
        lines.append(f"| {flags} | {env_cell} | {default.replace('|', '/')} | {', '.join(cmds)} | {meaning} |")
    return "\n".join(lines)


def global_flag_table(parser: argparse.ArgumentParser) -> str:
    """The table of the flags that come before the subcommand (logging)."""
    lines = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for action in flag_actions(parser):
        help_text, default, env = getattr(action, "doc", (action.help or "", "", None))
        lines.append(f"| `{action.option_strings[0]}` | `{env}` | {default} | {help_text} |")
    return "\n".join(lines)


def render_docs_tables() -> dict[str, str]:
    """The generated tables of docs/operations.md, by marker name."""
    from tandem.cli import build_parser

    parser = build_parser()
    return {
        "flags-servers": flag_table(parser, ["serve", "engine", "frontend"]),
        "flags-clients": flag_table(parser, ["chat", "generate"]),
        "flags-global": global_flag_table(parser),
    }


def update_docs(path: str = "docs/operations.md", check: bool = False) -> bool:
    """Rewrites (or, with `check`, compares) the text between `<!-- NAME -->` and
    `<!-- /NAME -->` markers; returns whether the file was already up to date."""
    with open(path) as f:
        text = f.read()
    new = text
    for name, table in render_docs_tables().items():
        start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
        i, j = new.index(start) + len(start), new.index(end)
        new = new[:i] + "\n" + table + "\n" + new[j:]
    if new != text and not check:
        with open(path, "w") as f:
            f.write(new)
    return new == text


if __name__ == "__main__":
    import sys

    up_to_date = update_docs(check="--check" in sys.argv)
    print("docs/operations.md flag tables are " + ("up to date" if up_to_date else
                                                   ("stale" if "--check" in sys.argv else "rewritten")))
    sys.exit(0 if up_to_date or "--check" not in sys.argv else 1)
