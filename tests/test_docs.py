"""The documentation holds together: README.md and docs/*.md link only to files and #anchors that exist, every
page opens with a paragraph saying what it covers, the README stays a front door, and docs/development.md's
layout table names every module of appliance/ and bench/ and nothing that is gone.

Anchors follow GitHub's rule for headings: the heading's text as rendered (code spans and emphasis reduced to
their text), lower-cased, every character that is not a letter, digit, space, `-` or `_` dropped, each space
turned into `-`; a repeated heading gets `-1`, `-2`, ... in order.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
LAYOUT_ROOTS = ("appliance", "bench")  # every module and package under these has its own row in the table

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold brackets one level deep and code spans
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's source text."""
    parts = []
    for i, part in enumerate(CODE_SPAN.split(heading)):  # text, fence, code, text, fence, code, ...
        if i % 3 == 2:
            parts.append(part.strip())  # a code span: its text as it is
        elif i % 3 == 0:
            part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)  # a link: its text
            part = re.sub(r"(\*\*|\*)(\S(?:.*?\S)?)\1", r"\2", part)  # *emphasis*
            part = re.sub(r"(?<!\w)(__|_)(\S(?:.*?\S)?)\1(?!\w)", r"\2", part)  # _emphasis_, not snake_case
            parts.append(re.sub(r"<[^>]+>", "", part))  # inline HTML tags
    return re.sub(r"[^\w\- ]", "", "".join(parts).lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every #anchor a page's headings define, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_targets(text: str):
    """(line number, target) of every link and image in a page's prose, code spans and code blocks left out."""
    for number, line in prose_lines(text):
        definition = REFERENCE_DEF.match(line)
        if definition:
            yield number, definition.group(1)
            continue
        for match in INLINE_LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def broken_links(pages: list[Path], root: Path) -> list[str]:
    """'page:line: target: why' for each relative link that names no file under `root`, or an anchor that the
    page it points to does not define. Links with a scheme (https:, mailto:) are not followed."""
    problems = []
    anchor_cache: dict[Path, set[str]] = {}
    for page in pages:
        for number, target in link_targets(page.read_text()):
            if not target or SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            where = f"{page.relative_to(root)}:{number}: {target}"
            dest = Path(os.path.normpath(page.parent / path_part)) if path_part else page
            if root not in dest.parents and dest != root:
                problems.append(f"{where}: points outside the repository")
                continue
            if not dest.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor:
                if dest.suffix != ".md":
                    problems.append(f"{where}: an anchor into a file that is not markdown")
                    continue
                if dest not in anchor_cache:
                    anchor_cache[dest] = anchors(dest.read_text())
                if anchor not in anchor_cache[dest]:
                    problems.append(f"{where}: {dest.relative_to(root)} has no heading #{anchor}")
    return problems


def doc_pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# --- the checker, on pages written for it ---------------------------------------------------------------------


def test_slugs_follow_githubs_rules():
    assert slug("Socket activation: the port stays open across restarts") == \
        "socket-activation-the-port-stays-open-across-restarts"
    assert slug("Agents and chat UIs: tools, reasoning, structured outputs, sampling") == \
        "agents-and-chat-uis-tools-reasoning-structured-outputs-sampling"
    assert slug("`GET /v1/models`") == "get-v1models"
    assert slug("Running in a container (Podman)") == "running-in-a-container-podman"
    assert slug("What was tested here, and what was not") == "what-was-tested-here-and-what-was-not"
    assert slug("**Bold** and `max_tokens` and snake_case") == "bold-and-max_tokens-and-snake_case"
    assert slug("8 -> 16 clients") == "8---16-clients"
    assert slug("_Why_ `a_b_` __c__") == "why-a_b_-c"


def test_the_checker_finds_every_kind_of_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Install\n\n## Install\n\n## `openarc serve`\n")
    (tmp_path / "docs" / "notes.txt").write_text("plain text\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Front door\n\n## Quick start: one model\n\n"
        "Good: [a](docs/other.md), [b](docs/other.md#install-1), [c](docs/other.md#openarc-serve),\n"
        "[d](#quick-start-one-model), [e](docs/), [f](https://example.com/nowhere#x), ![g](docs/notes.txt),\n"
        "`[not a link](missing.md)` and [h][ref].\n\n"
        "```sh\n# a comment, not a heading\necho [nor a link](missing.md)\n```\n\n"
        "Broken: [i](docs/missing.md), [j](docs/other.md#install-2), [k](#nowhere),\n"
        "[l](docs/notes.txt#top), [m](../outside.md).\n\n"
        "[ref]: docs/other.md#other-page\n[bad]: docs/gone.md\n")
    problems = broken_links([page], tmp_path)
    assert [p.split(": ", 2)[:2] for p in problems] == [
        ["README.md:14", "docs/missing.md"], ["README.md:14", "docs/other.md#install-2"],
        ["README.md:14", "#nowhere"], ["README.md:15", "docs/notes.txt#top"], ["README.md:15", "../outside.md"],
        ["README.md:18", "docs/gone.md"]], problems
    assert "has no heading #install-2" in problems[1]
    assert "#a-comment-not-a-heading" not in anchors(page.read_text())


def test_a_broken_link_planted_in_the_real_docs_is_found(tmp_path):
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copytree(DOCS, tmp_path / "docs")
    for entry in REPO.iterdir():  # what the pages link to besides each other: the tree, by symbolic links
        if entry.name not in {"README.md", "docs", ".git"}:
            (tmp_path / entry.name).symlink_to(entry)
    assert broken_links(doc_pages(tmp_path), tmp_path) == []
    with open(tmp_path / "docs" / "operations.md", "a") as page:
        page.write("\nSee [the failure table](failures.md#the-failure-tabel).\n")
    problems = broken_links(doc_pages(tmp_path), tmp_path)
    assert len(problems) == 1 and "failures.md has no heading #the-failure-tabel" in problems[0], problems


# --- the real pages -------------------------------------------------------------------------------------------


def test_every_link_in_the_readme_and_docs_resolves():
    problems = broken_links(doc_pages(), REPO)
    assert not problems, "\n".join(problems)


def test_every_doc_page_opens_with_a_paragraph_saying_what_it_covers():
    for page in sorted(DOCS.glob("*.md")):
        blocks = [b for b in page.read_text().split("\n\n") if b.strip()]
        assert re.match(r"# \S", blocks[0]) and "\n" not in blocks[0].strip(), f"{page.name}: no title line"
        first = blocks[1].lstrip()
        assert not re.match(r"(#|\||```|- |\* |\d+\. |>)", first), \
            f"{page.name}: the title must be followed by a paragraph saying what the page covers"


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "make test" in text and "make serve" in text  # the two commands; CI's .ci/run calls `make test`
    linked = {target.partition("#")[0] for _, target in link_targets(text)}
    missing = [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in linked]
    assert missing == [], f"pages the README's map of the docs does not link: {missing}"


# --- the layout table of docs/development.md ------------------------------------------------------------------


def layout_rows(text: str) -> dict[str, str]:
    """The layout table (the one whose header is `| path | concern |`): {path: concern}, one path per row."""
    rows, in_table = {}, False
    for line in text.splitlines():
        if re.match(r"\|\s*path\s*\|\s*concern\s*\|", line):
            in_table = True
            continue
        if in_table:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set(cells[0]) <= set("-: "):
                continue
            path = re.fullmatch(r"`([^`]+)`", cells[0])
            assert path, f"a layout row names one path in backticks, not {cells[0]!r}"
            assert path.group(1) not in rows, f"{path.group(1)} has two rows"
            rows[path.group(1)] = cells[1]
    return rows


def modules_and_packages(root: Path = REPO) -> set[str]:
    """Every module (`x.py`, not `__init__.py`, which its package's row covers) and package (`x/`) under the
    layout's roots, as paths relative to the repository."""
    found = set()
    for top in LAYOUT_ROOTS:
        for path in (root / top).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(root)
            found.add(f"{relative.parent}/" if path.name == "__init__.py" else str(relative))
    return found


def test_the_layout_table_matches_the_tree():
    rows = layout_rows((DOCS / "development.md").read_text())
    assert rows, "docs/development.md has no `| path | concern |` table"
    problems = [f"{path}: no row in docs/development.md's layout table (add one)"
                for path in sorted(modules_and_packages() - set(rows))]
    problems += [f"{path}: a row of the layout table, but no such path" for path in rows if not (REPO / path).exists()]
    problems += [f"{path}: a row of the layout table with no concern" for path, concern in rows.items() if not concern]
    assert not problems, "\n".join(problems)


def test_the_layout_check_sees_a_new_module_and_a_removed_one(tmp_path):
    for top in LAYOUT_ROOTS:
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "appliance" / "front" / "newcomer.py").write_text('"""A module nobody documented."""\n')
    (tmp_path / "appliance" / "host" / "notify.py").unlink()
    rows = layout_rows((DOCS / "development.md").read_text())
    assert modules_and_packages(tmp_path) - set(rows) == {"appliance/front/newcomer.py"}
    assert [path for path in rows if path.endswith(".py") and not (tmp_path / path).exists()] == \
        ["appliance/host/notify.py"]
