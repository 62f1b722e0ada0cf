"""Every relative link in the project's documentation leads somewhere.

The README is a page of links into docs/, and the docs link to each other's sections: a file
renamed or a heading reworded would otherwise leave a reader at a dead end that nobody notices.
A link is checked as GitHub renders it: the target file (or directory) must exist, relative to
the file that links to it, and a `#fragment` must name a heading of the target Markdown file
(GitHub's anchor: lower case, punctuation dropped, spaces to hyphens, `-1`, `-2`... for
repeats). Links inside code (fenced blocks, `inline code`) are not links, and absolute URLs
are somebody else's to keep alive.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent

# The documentation a reader follows links in (the butlers' CLAUDE.md files are prompts).
DOC_GLOBS = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/*.md", "deploy/**/*.md")

FENCE = re.compile(r"^ {0,3}(```|~~~)")
# A code span: a run of backticks up to the next run of the same length, within a paragraph
# (it may cross a line break, never a blank line).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?:(?!\n\s*\n).)+?(?<!`)\1(?!`)", re.DOTALL)
# [text](target) or [text](target "title"), the text possibly wrapped over lines; images
# ![alt](src) are links to files too.
INLINE_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, mailto:, ...


def outside_fences(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1) == fence:
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        lines.append((number, line))
    return lines


def prose(text: str) -> str:
    """The text outside fenced blocks and code spans, each removed part blanked but for its
    line breaks, so an offset still falls on its line."""
    kept = dict(outside_fences(text))
    lines = [kept.get(number, "") for number in range(1, len(text.splitlines()) + 1)]

    def blank(match: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    return CODE_SPAN.sub(blank, "\n".join(lines))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (without its repeat suffix): inline code keeps
    its text, a link its label."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def heading_anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match is None:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(doc: Path, root: Path) -> list[str]:
    """What is wrong with each relative link of `doc`: `file:line: target: why`."""
    problems: list[str] = []
    where = doc.relative_to(root)
    text = prose(doc.read_text(encoding="utf-8"))
    for match in INLINE_LINK.finditer(text):
        target = match.group(1)
        if EXTERNAL.match(target):
            continue
        said = f"{where}:{text.count(chr(10), 0, match.start(1)) + 1}: {target}"
        path_part, _, fragment = target.partition("#")
        resolved = (doc.parent / unquote(path_part)).resolve() if path_part else doc
        if not resolved.exists():
            problems.append(f"{said}: no such file {path_part}")
        elif not fragment:
            continue
        elif resolved.is_dir() or resolved.suffix != ".md":
            problems.append(f"{said}: #{fragment} of a non-Markdown file")
        elif unquote(fragment).lower() not in heading_anchors(resolved):
            shown = resolved.relative_to(root) if resolved.is_relative_to(root) else resolved
            problems.append(f"{said}: no heading #{fragment} in {shown}")
    return problems


def documents(root: Path) -> list[Path]:
    """The Markdown files of DOC_GLOBS under `root`, each once, in a stable order."""
    return sorted({path for pattern in DOC_GLOBS for path in root.glob(pattern)})


def test_the_docs_exist() -> None:
    """The README's pages are there (a glob that matched nothing would check nothing)."""
    names = {path.relative_to(REPO).as_posix() for path in documents(REPO)}
    for expected in (
        "README.md",
        "docs/architecture.md",
        "docs/cli.md",
        "docs/gateway.md",
        "docs/operations.md",
    ):
        assert expected in names, sorted(names)


@pytest.mark.parametrize("doc", documents(REPO), ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    problems = broken_links(doc, REPO)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    """The checker itself: a missing file, a missing heading, a link in code that is not a
    link (also in a code span across lines), a repeated heading's suffix, a directory link and
    a link whose text is wrapped over two lines."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Set `up`: now\n\n## Twice\n\n## Twice\n", encoding="utf-8"
    )
    (tmp_path / "README.md").write_text(
        "\n".join(
            [
                "# Readme",
                "[ok](docs/a.md) [ok](docs/a.md#set-up-now) [ok](docs/a.md#twice-1)",
                "[ok](docs) [ok](#readme) [ok](https://example.com/nothing#here)",
                "`[not a link](nowhere.md)`",
                "```",
                "[not a link](nowhere.md)",
                "```",
                "[gone](docs/b.md)",
                "[no heading](docs/a.md#setup)",
                "[no third](docs/a.md#twice-2)",
                "a `code span that",
                "wraps [not a link](nowhere.md)` and [a link whose",
                "text wraps](docs/c.md)",
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:8: docs/b.md: no such file docs/b.md",
        "README.md:9: docs/a.md#setup: no heading #setup in docs/a.md",
        "README.md:10: docs/a.md#twice-2: no heading #twice-2 in docs/a.md",
        "README.md:13: docs/c.md: no such file docs/c.md",
    ]


def test_the_gateway_toml_example_loads(tmp_path: Path) -> None:
    """docs/gateway.md's `gateway.toml` example, copied as it stands, is one the gateway
    takes: it had a top-level key under a suite's table, and the gateway refused to start
    (a walkthrough)."""
    from butlers.gateway.config import load_gateway_config

    text = (REPO / "docs" / "gateway.md").read_text()
    after = text.split("`gateway.toml` in `--dir`", 1)[1]
    example = after.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "gateway.toml").write_text(example)
    config = load_gateway_config(tmp_path)
    assert config.max_result_bytes == 4194304
    assert config.suites["playwright"].suite_name == "browser"
