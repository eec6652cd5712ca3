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
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


# --- the pages against the code and the server ------------------------------------------------------------------
# What a page says must be what the code does: every route the front registers is named in docs/api.md, every
# metric in docs/monitoring.md, every subcommand in the README, every doctor check in before-first-request.md;
# every YAML config a page shows passes check-config (its paths pointed at demo models of the same kind), every
# curl command and every Python example runs against served demo models and finishes (an answer cut by its token
# limit is a failure: the reader gets no JSON). A block that cannot run here (any other command: installs, systemd,
# the hub, a GPU) says so in the page, on the line before it: `<!-- docs-test: not run here: WHY -->`; no block is
# skipped silently.

NOT_RUN = re.compile(r"^\s*<!--\s*docs-test:\s*not run here:\s*(.+?)\s*-->\s*$")
FENCE_OPEN = re.compile(r"^ {0,3}(```|~~~)\s*(\w*)")
CONFIG_KEYS = {"server", "models"}


def code_blocks(page: Path) -> list[dict]:
    """Each fenced block of a page: {page, line, lang, text, not_run: the marker's reason or None}."""
    lines, blocks, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        match = FENCE_OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith(match.group(1)))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        blocks.append({"page": page.relative_to(REPO) if REPO in page.parents else page, "line": i + 1,
                       "lang": match.group(2), "text": "\n".join(lines[i + 1:end]),
                       "not_run": marker.group(1) if marker else None})
        i = end + 1
    return blocks


def all_blocks() -> list[dict]:
    return [block for page in doc_pages() for block in code_blocks(page)]


def test_a_marker_says_why_a_block_is_not_run(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# P\n\ntext\n\n<!-- docs-test: not run here: needs a GPU -->\n```sh\nls\n```\n\n```yaml\na: 1\n```\n")
    assert [(b["lang"], b["not_run"]) for b in code_blocks(page)] == [("sh", "needs a GPU"), ("yaml", None)]


def served_app():
    """The front's aiohttp app as it is built, for its routes and metrics (no worker, no socket)."""
    from types import SimpleNamespace
    from appliance.config import demo_config
    from appliance.front.app import make_app
    from appliance.front.metrics import Metrics
    from appliance.front.spool_budget import SpoolBudget
    metrics = Metrics()
    return make_app(SimpleNamespace(config=demo_config(), metrics=metrics, spool_budget=SpoolBudget())), metrics


def test_every_route_the_front_registers_is_in_the_api_pages_table_and_every_kind_in_its_models_section():
    from appliance.config.kinds import MODEL_KINDS
    app, _ = served_app()
    text = (DOCS / "api.md").read_text()
    table = "\n".join(line for line in text.split("\n## ")[0].splitlines() if line.startswith("| ["))
    missing = sorted({f"{r.method} {r.resource.canonical}" for r in app.router.routes()
                      if r.method != "HEAD" and f"`{r.method} {r.resource.canonical}`" not in table
                      and f"{r.method} {r.resource.canonical}`" not in table})
    assert not missing, f"routes docs/api.md's route table does not name: {missing}"
    models_section = text.split("## `GET /v1/models`")[1].split("\n## ")[0]
    assert [kind for kind in MODEL_KINDS if f"`{kind}`" not in models_section] == []


def test_every_kind_has_a_row_in_the_model_kinds_table():
    from appliance.config.kinds import MODEL_KINDS
    rows = set(re.findall(r"^\| `(\w+)`", (DOCS / "model-kinds.md").read_text(), re.M))
    assert [kind for kind in MODEL_KINDS if kind not in rows] == []


def test_every_metric_the_code_defines_is_named_in_the_monitoring_page():
    _, metrics = served_app()
    text = (DOCS / "monitoring.md").read_text()
    missing = sorted(family.name for family in metrics.registry.collect()
                     if not re.search(rf"\b{family.name}(_total)?\b", text))
    assert not missing, f"metrics docs/monitoring.md does not name: {missing}"


def test_every_subcommand_is_named_in_the_readme():
    from appliance.cli import parser
    commands = next(a for a in parser()._actions if a.dest == "command").choices
    text = (REPO / "README.md").read_text()
    assert [c for c in commands if f"openarc {c}" not in text and f"`{c}`" not in text] == []


def doctor_row(name: str) -> str:
    """A doctor check's name as the table in before-first-request.md writes it (a card's BDF, a node's number and a
    GPU's index are placeholders there)."""
    name = re.sub(r"\b[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]\b", "BDF", name)
    return re.sub(r"GPU\.\d+", "GPU.N", re.sub(r"renderD\d+", "renderDN", name))


def test_every_doctor_check_this_box_fails_has_a_row_in_before_first_request():
    from appliance.host import doctor
    text = (DOCS / "before-first-request.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)`", text, re.M))
    checks = {doctor_row(check.name) for check in doctor.diagnose("/", None, None) if check.status in ("fail", "warn")}
    assert sorted(checks - rows) == [], "doctor checks with no row in docs/before-first-request.md"


def tracked_files() -> set[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    return {REPO / name for name in listed.stdout.split("\0") if name}


def test_no_page_points_at_a_path_outside_the_repository():
    """A relative path in a code span (`../x`) is a reference too, and must name a file the repository holds: a
    user's clone has nothing beside it (the team's ../shared folder here is not theirs)."""
    tracked = tracked_files()
    folders = {parent for path in tracked for parent in path.parents}
    problems = []
    for page in doc_pages():
        for number, line in prose_lines(page.read_text()):
            for _, span in CODE_SPAN.findall(line):
                if span.startswith("../"):
                    dest = Path(os.path.normpath(page.parent / span.split()[0]))
                    if dest not in tracked and dest not in folders:
                        problems.append(f"{page.relative_to(REPO)}:{number}: {span}: not in the repository")
    assert not problems, "\n".join(problems)


def test_the_reference_config_marks_what_is_only_an_example():
    """A key the server leaves unset by default (decided at run time: sdpa_optimization, enable_weightless, ...)
    shown with a value in configuration.md's reference config says it is an example: copied as it stands, it would
    pin the value on every model."""
    import dataclasses
    from appliance.config import ModelConfig, ServerConfig
    text = (DOCS / "configuration.md").read_text()
    block = next(b for b in code_blocks(DOCS / "configuration.md") if b["lang"] == "yaml")["text"]
    server_part, _, models_part = block.partition("\nmodels:")
    data = yaml.safe_load(block)
    problems = []
    for cls, part, values in [(ServerConfig, server_part, [data.get("server") or {}]),
                              (ModelConfig, models_part, data.get("models") or [])]:
        keys = {f.name for f in dataclasses.fields(cls) if f.default is None
                and any(v.get(f.name) is not None for v in values)}
        problems += [line.strip() for line in part.splitlines()
                     if (key := re.match(r"^\s*(?:- )?(\w+):\s*[^#\s]", line)) and key.group(1) in keys
                     and "example" not in line.partition("#")[2]]
    assert not problems, f"unset-by-default keys shown with a value and no 'example' in their comment: {problems}"
    assert "applies to kind 'llm' models only" not in text  # an error text the code no longer writes


# --- config blocks through check-config --------------------------------------------------------------------------

def as_config(data) -> dict | None:
    """A YAML block as a whole config: a models list alone becomes `models`; server settings alone get a model
    for each name they route to (aliases, a key's models). None: not an openarc config (another program's)."""
    if isinstance(data, list):
        return {"models": data}
    if not isinstance(data, dict) or not set(data) <= CONFIG_KEYS:
        return None
    config = dict(data)
    if "models" not in config:
        server = config.get("server") or {}
        names = set((server.get("model_aliases") or {}).values())
        names |= {m for key in server.get("api_keys") or [] for m in key.get("models") or [] if "*" not in m}
        config["models"] = [{"name": name, "path": "", "device": "CPU"} for name in sorted(names) or ["demo"]]
    return config


@pytest.fixture(scope="module")
def demo_paths(demo_model, embedding_model, rerank_model, demo_tts, demo_whisper, demo_vlm,
               demo_image) -> dict[str, str]:
    return {"llm": str(demo_model), "embedding": str(embedding_model), "rerank": str(rerank_model),
            "tts": str(demo_tts), "transcription": str(demo_whisper), "vlm": str(demo_vlm), "image": str(demo_image)}


def pointed_at_demo_models(config: dict, paths: dict[str, str]) -> dict:
    for model in config.get("models") or []:
        model["path"] = paths[model.get("kind", "llm")]
        if isinstance(model.get("draft_model"), dict):
            model["draft_model"]["path"] = paths["llm"]
        if isinstance(model.get("voices"), dict):  # a real model's voice files: the demo's own stand in for them
            demo_voice = sorted((Path(paths["tts"]) / "voices").iterdir())[0]
            model["voices"] = {name: str(demo_voice) for name in model["voices"]}
        if isinstance(model.get("adapters"), dict):  # a real model's LoRA files: the demo's adapter stands in
            from appliance.demo.catalog import image_adapter_path
            model["adapters"] = {name: str(image_adapter_path(paths["image"])) for name in model["adapters"]}
    return config


def config_problems(block: dict, paths: dict[str, str], tmp_path: Path, monkeypatch) -> str | None:
    from appliance.config import ConfigError, load_config
    from appliance.config.model_checks import path_check
    config = as_config(yaml.safe_load(block["text"]))
    if config is None:
        return "not an openarc config: mark it `<!-- docs-test: not run here: ... -->`"
    path = tmp_path / f"{block['line']}.yaml"
    path.write_text(yaml.safe_dump(pointed_at_demo_models(config, paths)))
    server = config.get("server") or {}
    for key_env in [server.get("api_key_env")] + [k.get("key_env") for k in server.get("api_keys") or []]:
        if key_env:
            monkeypatch.setenv(key_env, f"docs-test-{key_env}")
    try:
        load_config(path, [path_check]).key_secrets()  # what `openarc check-config` checks
    except ConfigError as exc:
        return "; ".join(exc.lines)
    return None


def test_every_config_a_page_shows_passes_check_config(demo_paths, tmp_path, monkeypatch):
    problems = []
    for block in all_blocks():
        if block["lang"] == "yaml" and not block["not_run"]:
            problem = config_problems(block, demo_paths, tmp_path, monkeypatch)
            if problem:
                problems.append(f"{block['page']}:{block['line']}: {problem}")
    assert not problems, "\n".join(problems)


# --- curl commands and Python examples against served demo models ------------------------------------------------

DOC_HOSTS = re.compile(r"(?:(https?|wss?)://)?(?:localhost|127\.0\.0\.1):8000")
# The curl the pages' commands run: the real one, failing on a 4xx/5xx with the body shown, and failing on an
# answer its token limit cut (a reader gets no whole JSON from it).
CURL_WRAPPER = """#!/bin/sh
out=$(command -p curl --fail-with-body -sS "$@") || { echo "$out"; exit 22; }
echo "$out"
case "$out" in *'"finish_reason": "length"'*|*'"finish_reason":"length"'*|*'"status": "incomplete"'*) \
  echo "docs-test: the answer was cut by its token limit" >&2; exit 3;; esac
"""


def doc_model_kinds() -> dict[str, str]:
    """Every model name a page's config defines, with its kind: served here as a demo model of that kind."""
    kinds = {}
    for block in all_blocks():
        if block["lang"] != "yaml":
            continue
        config = as_config(yaml.safe_load(block["text"])) or {}
        for model in config.get("models") or []:
            if isinstance(model, dict) and model.get("name"):
                kinds.setdefault(model["name"], model.get("kind", "llm"))
    return kinds


@pytest.fixture(scope="module")
def docs_server(demo_paths, tmp_path_factory):
    from conftest import Appliance, model_entry
    names = {"llm": "demo", "embedding": "demo-embedding", "rerank": "demo-rerank", "vlm": "demo-vlm",
             "image": "demo-image"}
    config = {"server": {"model_aliases": {name: names[kind] for name, kind in doc_model_kinds().items()
                                           if kind in names and name not in names.values()}},
              "models": [model_entry(name, Path(demo_paths[kind]), kind=kind, max_context=8192)
                         for kind, name in names.items()]}
    app = Appliance(config, tmp_path_factory.mktemp("docs-server"))
    try:
        yield app.start()
    finally:  # a start that failed leaves its process too
        app.stop()


def run_block(block: dict, app, tmp_path: Path) -> str | None:
    """None if the block ran and finished, else what went wrong."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "curl").write_text(CURL_WRAPPER)
    (bin_dir / "curl").chmod(0o755)
    text = DOC_HOSTS.sub(lambda m: f"{m.group(1) or 'http'}://127.0.0.1:{app.port}", block["text"])
    argv = ["bash", "-e", "-c", text] if block["lang"] in ("sh", "bash", "") else [sys.executable, "-c", text]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return None if done.returncode == 0 else f"exit {done.returncode}: {(done.stdout + done.stderr)[-600:]}"


def runnable(block: dict) -> bool:
    if block["not_run"]:
        return False
    if block["lang"] in ("sh", "bash", ""):
        return bool(re.search(r"^\s*curl ", block["text"], re.M))
    return block["lang"] == "python"


def test_every_command_block_runs_here_or_says_why_not():
    """A shell block runs when it is curl against the server; any other command (installs, systemd, the hub, a
    GPU) cannot run in the tests and must carry the marker saying why. Plain blocks (output) are not commands."""
    unmarked = [f"{b['page']}:{b['line']}" for b in all_blocks() if b["lang"] in ("sh", "bash", "console")
                and not b["not_run"] and not runnable(b)]
    assert not unmarked, f"command blocks neither run nor marked `<!-- docs-test: not run here: WHY -->`: {unmarked}"


def test_every_curl_and_python_example_runs_on_the_demo_models(docs_server, tmp_path):
    problems = []
    for block in filter(runnable, all_blocks()):
        problem = run_block(block, docs_server, tmp_path)
        if problem:
            problems.append(f"{block['page']}:{block['line']} ({block['lang']}): {problem}")
    assert not problems, "\n\n".join(problems)
