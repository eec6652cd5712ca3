"""The tree shows the process boundary: `appliance/front/` (the aiohttp front) never imports OpenVINO or the
worker, `appliance/worker/` never imports aiohttp, and every module's side is clear from its path.

Imports are read from the source (every `import`, at the top or inside a function) and followed through the
appliance modules they reach, so a front module that imports a shared module that imports OpenVINO fails too.
The last test imports the front for real and looks at `sys.modules`.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "appliance"
OPENVINO = ("openvino", "openvino_genai", "openvino_tokenizers")

# Each room of the tree and what it may never reach, directly or through another appliance module.
FORBIDDEN = {
    "appliance.front": OPENVINO + ("appliance.worker", "appliance.demo"),
    "appliance.worker": ("aiohttp", "appliance.front"),
    "appliance.host": OPENVINO + ("aiohttp", "appliance.front", "appliance.worker"),
    # the config and what it is made of, read by the CLI, the front and the worker (the spec it is launched with, a
    # draft's tokenizer check): neither process's own code, nor OpenVINO (the host's devices are asked in a child)
    "appliance.config": OPENVINO + ("aiohttp", "appliance.front", "appliance.worker", "appliance.demo"),
    # `openarc launch`: the CLI's alone; it reads a config or a server's answer and writes an agent's files
    "appliance.launch": OPENVINO + ("aiohttp", "appliance.front", "appliance.worker", "appliance.demo"),
    # golden answers: the probes, the record file and the comparison, pure; the front runs the probes
    "appliance.golden": OPENVINO + ("aiohttp", "appliance.front", "appliance.worker", "appliance.demo"),
}
# Modules at the top are shared by both processes (or are the CLI, which starts either): what they import is
# checked by the rooms above, and the list is closed so that a new top-level module must say why it is there.
SHARED = {"__init__", "__main__", "chat_formats", "cli", "ipc", "logs",
          # what a model directory is (kind, IR files): the config's check, the front's start and `openarc pull`
          "model_files",
          # `openarc pull`: downloads through huggingface_hub; the CLI's alone, neither process imports it
          "pull",
          # byte sizes: the config's, the host's fdinfo readers' and the front's messages read and write them alike
          "sizes"}
ROOMS = {"front", "worker", "demo", "host", "config", "launch", "golden"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


@functools.cache  # every room's walk reads the same files: parse each once (it took ~9 s a room on a quiet core)
def imports_of(path: Path, name: str) -> frozenset[str]:
    """Every module `path` imports, absolute; `from X import Y` counts Y too when X.Y is a module."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(found)


def reached(start: str, modules: dict[str, Path]) -> dict[str, str]:
    """Every module `start` reaches through appliance modules, each with the appliance module that imports it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for imported in imports_of(modules[current], current):
            if imported in seen:
                continue
            if imported.startswith("appliance") and imported not in modules:
                continue  # `from appliance.x import name`: the name, not a module
            seen[imported] = current
            if imported in modules:
                todo.append(imported)
    return seen


def violations(room: str, modules: dict[str, Path]) -> list[str]:
    found = []
    for name in sorted(m for m in modules if m == room or m.startswith(room + ".")):
        for imported, via in reached(name, modules).items():
            for banned in FORBIDDEN[room]:
                if imported == banned or imported.startswith(banned + "."):
                    found.append(f"{name} reaches {imported} (imported by {via})")
    return found


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_no_module_crosses_the_process_boundary(room):
    assert violations(room, all_modules()) == []


def test_a_planted_openvino_import_in_the_front_is_caught(tmp_path, monkeypatch):
    """The check above can fail: a front module that imports OpenVINO inside a function, two hops away."""
    modules = all_modules()
    planted = tmp_path / "planted.py"
    planted.write_text("def later():\n    import openvino_genai\n")
    helper = tmp_path / "helper.py"
    helper.write_text("from appliance.front import planted\n")
    modules["appliance.front.planted"] = planted
    modules["appliance.front.helper"] = helper
    assert violations("appliance.front", modules) == [
        "appliance.front.helper reaches openvino_genai (imported by appliance.front.planted)",
        "appliance.front.planted reaches openvino_genai (imported by appliance.front.planted)",
    ]


def test_every_module_lives_in_a_room_or_is_shared():
    loose = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem not in SHARED)
    rooms = sorted(path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__")
    assert loose == [] and rooms == sorted(ROOMS)


def test_the_front_process_never_loads_openvino():
    """The real thing: import the front's app, its supervisors and the CLI, then look at what Python loaded."""
    code = ("import sys, appliance.cli, appliance.front.server, appliance.front.supervisor, "
            "appliance.front.api.generate, appliance.front.api.audio\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'openvino', 'openvino_genai', "
            "'openvino_tokenizers'} or m.startswith('appliance.worker')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_bench_imports_only_public_entry_points():
    """The bench drives the appliance from outside (`python -m appliance serve`, HTTP): it may build demo models,
    read a config and the spec a worker gets, read a process's RSS, and configure a pipeline as a worker does for
    its in-process baseline; it never reaches into the front's supervisors, routes or requests."""
    public = {"appliance.config", "appliance.demo.catalog", "appliance.host.telemetry",
              "appliance.worker.engines.batching", "appliance.worker.engines.embedding"}
    used = set()
    for path in (REPO / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("appliance"):
                used.add(node.module)
    assert used <= public, used - public


def test_every_pattern_reading_digits_reads_ascii_ones():
    """`\\d` in a str pattern matches any script's digits: `size: "５１２x５１２"` passed the image route's check
    and int() took it; a device named `GPU.١` passed the config's. Every pattern in the tree that reads `\\d` says
    re.ASCII, so a digit is 0-9 wherever input is read."""
    unmarked = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args):
                continue
            pattern = node.args[0]
            text = "".join(part.value for part in ast.walk(pattern)
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            if "\\d" in text and "ASCII" not in ast.unparse(node):
                unmarked.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not unmarked, unmarked


DIGIT_TESTS = ("isdigit", "isdecimal", "isnumeric")


def test_every_digit_test_of_a_string_is_an_ascii_one():
    """str.isdigit() is true of any script's digits and of "²", on which int() raises: a JSON pointer "#/items/²" in
    a chat request's schema passed bounds.resolve's isdigit() and int() made it a 500. Every such test in the tree is
    `text.isascii() and text.isdigit()` (0-9 only, which int() always reads), the same `text` on both sides."""
    unmarked = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
                ascii_of = {ast.unparse(call.func.value) for call in node.values if _method_call(call, "isascii")}
                guarded |= {id(call) for call in node.values if any(_method_call(call, name) for name in DIGIT_TESTS)
                            and ast.unparse(call.func.value) in ascii_of}
        unmarked += [f"{path.relative_to(REPO)}:{node.lineno}" for node in ast.walk(tree)
                     if any(_method_call(node, name) for name in DIGIT_TESTS) and id(node) not in guarded]
    assert not unmarked, unmarked


def _method_call(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
