"""The documentation: a short README for users, links that resolve, and every command and flag of the
CLI documented in docs/cli.md (a flag added without its documentation fails here)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from sapp_hook.cli import build_parser

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MAX_README_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    text = prose(page.read_text())
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("#")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens,
    repeated headings numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings if option not in ("-h", "--help")]


def test_readme_is_short_and_says_how_to_set_up():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert "make demo" in text
    assert "make test" in text


def test_the_pages_are_found():
    names = {page.relative_to(ROOT).as_posix() for page in PAGES}
    assert {"README.md", "docs/cli.md", "docs/api.md", "docs/design/memory-model.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file(page):
    broken = []
    for target in links(page):
        if not is_relative(target):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).resolve().is_file():
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_anchor_names_a_heading(page):
    broken = []
    for target in links(page):
        if "#" not in target or not is_relative(target):
            continue
        path, anchor = target.split("#", 1)
        linked = (page.parent / path).resolve() if path else page
        if linked.suffix == ".md" and linked.is_file() and anchor not in anchors(linked):
            broken.append(target)
    assert broken == []


def test_the_link_checks_find_broken_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text(
        "[ok](there.md#a-heading) [gone](missing.md) [web](https://example.com) "
        "`[code](not-a-link.md)`\n\n[bad anchor](there.md#elsewhere)\n```\n[x](in-code.md)\n```\n"
    )
    assert links(page) == ["there.md#a-heading", "missing.md", "https://example.com", "there.md#elsewhere"]
    assert anchors(tmp_path / "there.md") == {"a-heading"}


def test_every_command_is_documented():
    text = CLI_DOC.read_text()
    missing = [name for name in subcommands() if not re.search(rf"sapp-hook {re.escape(name)}\b", text)]
    assert missing == []


def test_every_flag_is_documented():
    text = CLI_DOC.read_text()
    parsers = {"sapp-hook": build_parser(), **{f"sapp-hook {name}": sub for name, sub in subcommands().items()}}
    missing = [
        f"{command} {option}"
        for command, parser in parsers.items()
        for option in option_strings(parser)
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text)
    ]
    assert missing == []


PACKAGES = ("basics", "simulator", "solver", "profiler", "sapp_hook")


def _modules_with_examples() -> list[str]:
    """The modules whose docstrings hold `>>>` examples."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if ">>> " in path.read_text(encoding="utf-8"):
                found.append(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
    return found


@pytest.mark.parametrize("name", _modules_with_examples())
def test_every_docstring_example_runs_as_shown(name):
    import doctest
    import importlib

    failed, tried = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert tried and not failed
