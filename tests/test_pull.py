"""`openarc pull` against a stand-in hub (tests/standin_hub.py, through HF_ENDPOINT) serving the demo models as
repositories: what arrives, the kind detected, the entry printed or added to a config that check-config accepts and
`openarc serve` serves; repositories that are not OpenVINO models refused with the command that converts them; an
unreachable hub in one line."""

from __future__ import annotations

import json
import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, Appliance, free_port
from standin_hub import StandinHub

DEMO_REPOS = {"llm": "openarc-test/demo-llm-ov", "vlm": "openarc-test/demo-vlm-ov", "embedding": "openarc-test/demo-embedding-ov",
              "rerank": "openarc-test/demo-rerank-ov", "transcription": "openarc-test/demo-whisper-ov"}
PYTORCH_REPO, GGUF_REPO = "Qwen/Qwen2.5-0.5B-Instruct", "bartowski/Qwen2.5-0.5B-Instruct-GGUF"
# An llm's files with weights larger than huggingface_hub's download chunk (10 MiB): what arrives of it before a
# lost connection is kept and resumed from (smaller pieces are fetched again whole). Pulled, never served.
BIG_REPO, BIG_WEIGHTS = "openarc-test/big-weights-ov", 12 << 20


@pytest.fixture(scope="module")
def demo_dirs(demo_model, demo_vlm, embedding_model, rerank_model, demo_whisper):
    return {"llm": demo_model, "vlm": demo_vlm, "embedding": embedding_model, "rerank": rerank_model,
            "transcription": demo_whisper}


@pytest.fixture(scope="module")
def hub(demo_dirs, tmp_path_factory):
    pytorch = tmp_path_factory.mktemp("pytorch")
    (pytorch / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    (pytorch / "model.safetensors").write_bytes(b"\0" * 4096)
    (pytorch / "tokenizer.json").write_text("{}")
    gguf = tmp_path_factory.mktemp("gguf")
    (gguf / "qwen2.5-0.5b-instruct-q4_k_m.gguf").write_bytes(b"GGUF" + b"\0" * 4096)
    (gguf / "README.md").write_text("quantized from Qwen/Qwen2.5-0.5B-Instruct\n")
    big = tmp_path_factory.mktemp("big") / "model"
    shutil.copytree(demo_dirs["llm"], big)
    (big / "openvino_model.bin").write_bytes(os.urandom(BIG_WEIGHTS))
    repos = {DEMO_REPOS[kind]: path for kind, path in demo_dirs.items()}
    with StandinHub({**repos, PYTORCH_REPO: pytorch, GGUF_REPO: gguf, BIG_REPO: big}) as hub:
        yield hub


def pull(tmp_path: Path, endpoint: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "HF_TOKEN"}, "PYTHONPATH": str(REPO), "HF_ENDPOINT": endpoint,
           "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "appliance", "pull", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


def model_files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*")
            if p.is_file() and ".cache" not in p.relative_to(path).parts}


@pytest.mark.parametrize("kind", sorted(DEMO_REPOS))
def test_a_pulled_model_arrives_whole_and_its_kind_is_detected(hub, demo_dirs, tmp_path, kind):
    dest = tmp_path / "models" / "pulled"
    done = pull(tmp_path, hub.url, DEMO_REPOS[kind], "--dir", str(dest))
    assert done.returncode == 0, done.stderr
    assert model_files_of(dest) == model_files_of(demo_dirs[kind])
    # stdout is the entry alone (a comment and YAML), ready to paste under `models:`
    entry = yaml.safe_load(done.stdout)
    assert entry == [{"name": DEMO_REPOS[kind].split("/")[1], "path": str(dest), "kind": kind, "device": "CPU"}]
    # Not a terminal: plain lines, no progress bar drawing.
    assert f"an OpenVINO {kind} model" in done.stderr and "\r" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"{len(model_files_of(dest))}/{len(model_files_of(dest))} files")


def test_a_terminal_gets_progress_bars(hub, tmp_path):
    """stderr on a pseudo-terminal: huggingface_hub draws its bars (redrawn in place), not our plain lines."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a size
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "pull", DEMO_REPOS["llm"], "--dir",
                             str(tmp_path / "m")], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=child)
    os.close(child)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child side is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert proc.wait(180) == 0, shown.decode(errors="replace")
    proc.stdout.close()
    text = shown.decode(errors="replace")
    assert "\r" in text and "Fetching 12 files" in text and "100%" in text
    assert "openarc pull: 1/12 files" not in text


def test_a_private_repository_needs_hf_token(hub, demo_dirs, tmp_path):
    with StandinHub({"someone/private-ov": demo_dirs["embedding"]}) as private:
        private.tokens["someone/private-ov"] = "hf_secret"
        denied = pull(tmp_path, private.url, "someone/private-ov", "--dir", str(tmp_path / "p"))
        assert (denied.returncode, denied.stderr.strip()) == (
            1, f"openarc pull: no repository someone/private-ov on {private.url} (a private one needs HF_TOKEN)")
        allowed = pull(tmp_path, private.url, "someone/private-ov", "--dir", str(tmp_path / "p"), env={"HF_TOKEN": "hf_secret"})
    assert allowed.returncode == 0, allowed.stderr
    assert yaml.safe_load(allowed.stdout)[0]["kind"] == "embedding"


def test_pulling_again_fetches_nothing_already_there(hub, tmp_path):
    dest = tmp_path / "llm"
    assert pull(tmp_path, hub.url, DEMO_REPOS["llm"], "--dir", str(dest)).returncode == 0
    before = len(hub.fetched())
    again = pull(tmp_path, hub.url, DEMO_REPOS["llm"], "--dir", str(dest))
    assert again.returncode == 0, again.stderr
    assert hub.fetched()[before:] == []  # every file is there and known (huggingface_hub's metadata in DIR/.cache)


def test_a_download_cut_short_resumes_where_it_stopped(hub, tmp_path):
    hub.cut_once["openvino_model.bin"] = 11 << 20
    dest = tmp_path / "big"
    done = pull(tmp_path, hub.url, BIG_REPO, "--dir", str(dest))
    assert done.returncode == 0, done.stderr
    assert ("openvino_model.bin", f"bytes={10 << 20}-") in hub.ranges  # the rest, not the whole again
    assert model_files_of(dest) == model_files_of(hub.repos[BIG_REPO].root)


CONFIG = """\
# openarc config, hand-written: these comments must survive `openarc pull --add`.
server:
  host: 127.0.0.1
  port: {port}   # the test's port

models:
  # the embedding model for RAG
  - name: embed
    path: {embedding}
    kind: embedding
"""


def test_add_appends_an_entry_check_config_accepts_and_serve_serves(hub, demo_dirs, tmp_path):
    config = tmp_path / "openarc.yaml"
    original = CONFIG.format(port=free_port(), embedding=demo_dirs["embedding"])
    config.write_text(original)
    dest = tmp_path / "models" / "chat"
    done = pull(tmp_path, hub.url, DEMO_REPOS["llm"], "--dir", str(dest), "--name", "chat", "--add", str(config))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert f"added model 'chat' to {config} (appended; its comments are kept)" in done.stderr
    text = config.read_text()
    assert text.startswith(original)  # every comment and line as it was
    assert yaml.safe_load(text)["models"][1] == {"name": "chat", "path": str(dest), "kind": "llm", "device": "CPU"}
    checked = subprocess.run([sys.executable, "-m", "appliance", "check-config", str(config)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    first, *window = checked.stdout.strip().splitlines()
    assert first == f"{config}: OK: embed (CPU, embedding), chat (CPU)"
    assert window and window[0].startswith("openarc: model chat: context window ")  # the window the server serves
    # The file as written is what the server serves.
    app = Appliance(yaml.safe_load(text), tmp_path)
    app.config_path = config
    try:
        app.start()
        reply = app.client().chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 4
        assert app.client().embeddings.create(model="embed", input="hello").data[0].embedding
    finally:
        app.stop()


def test_add_refuses_a_name_the_config_has_and_changes_nothing(hub, demo_dirs, tmp_path):
    config = tmp_path / "openarc.yaml"
    config.write_text(CONFIG.format(port=8000, embedding=demo_dirs["embedding"]))
    before = config.read_text()
    done = pull(tmp_path, hub.url, DEMO_REPOS["embedding"], "--dir", str(tmp_path / "e"), "--name", "embed",
                "--add", str(config))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (f"openarc pull: {config} already has a model named 'embed'; "
                                                    "choose another with --name")
    assert config.read_text() == before
    assert not (tmp_path / "e").exists()  # refused before the download, not after it


def test_add_to_a_flow_style_list_rewrites_the_file_and_keeps_the_old_one(hub, demo_dirs, tmp_path):
    """pyyaml cannot keep comments when it writes a file: the user is told, and the previous file is kept."""
    config = tmp_path / "openarc.yaml"
    before = f"# mine\nmodels: [{{name: embed, path: {demo_dirs['embedding']}, kind: embedding}}]\nserver: {{port: 8000}}\n"
    config.write_text(before)
    done = pull(tmp_path, hub.url, DEMO_REPOS["rerank"], "--dir", str(tmp_path / "r"), "--add", str(config))
    assert done.returncode == 0, done.stderr
    assert "pyyaml keeps no comments, so the previous file is" in done.stderr
    assert (tmp_path / "openarc.yaml.bak").read_text() == before
    data = yaml.safe_load(config.read_text())
    assert [m["name"] for m in data["models"]] == ["embed", "demo-rerank-ov"] and data["server"] == {"port": 8000}


def test_add_creates_a_config_that_does_not_exist_yet(hub, tmp_path):
    config = tmp_path / "new.yaml"
    done = pull(tmp_path, hub.url, DEMO_REPOS["transcription"], "--dir", str(tmp_path / "w"), "--add", str(config))
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(config.read_text())["models"][0]["kind"] == "transcription"
    assert oct(config.stat().st_mode & 0o777) == "0o644"


def test_a_pytorch_repository_is_refused_with_the_command_that_converts_it(hub, tmp_path):
    before = len(hub.fetched())
    dest = tmp_path / "qwen"
    done = pull(tmp_path, hub.url, PYTORCH_REPO, "--dir", str(dest))
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"openarc pull: {PYTORCH_REPO} is not an OpenVINO model (PyTorch/safetensors weights, not OpenVINO IR); "
        f"convert it with: optimum-cli export openvino --model {PYTORCH_REPO} --task text-generation-with-past "
        f"--weight-format int4 {dest}")
    assert hub.fetched()[before:] == ["config.json"]  # judged before any weights came
    assert not dest.exists()


def test_a_gguf_repository_is_refused_with_the_conversion_of_its_original(hub, tmp_path):
    done = pull(tmp_path, hub.url, GGUF_REPO, "--dir", str(tmp_path / "g"))
    assert done.returncode == 1
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith(f"openarc pull: {GGUF_REPO} is a GGUF repository")
    assert "optimum-cli export openvino --model <the original repository> --task text-generation-with-past " \
           "--weight-format int4" in line


def test_an_unknown_repository_or_revision_is_one_line(hub, tmp_path):
    done = pull(tmp_path, hub.url, "openarc-test/no-such-model")
    assert (done.returncode, done.stderr.strip()) == (1, f"openarc pull: no repository openarc-test/no-such-model on "
                                                         f"{hub.url} (a private one needs HF_TOKEN)")
    done = pull(tmp_path, hub.url, DEMO_REPOS["llm"], "--revision", "v9", "--dir", str(tmp_path / "x"))
    assert (done.returncode, done.stderr.strip()) == (1, f"openarc pull: {DEMO_REPOS['llm']} has no revision 'v9'")


def test_a_malformed_repository_id_is_named_as_such(tmp_path):
    """Said before any request (it was "cannot reach the hub ... check the network"), with the hub's own rule."""
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the id must be judged without it
    for repo_id, rule in (("OpenVINO/Qwen 7B", "Repo id must use alphanumeric chars, '-', '_' or '.'"),
                          ("a/b/c", "Repo id must be in the form 'repo_name' or 'namespace/repo_name'")):
        done = pull(tmp_path, endpoint, repo_id, "--dir", str(tmp_path / "x"))
        line = done.stderr.strip()
        assert done.returncode == 1 and "\n" not in line, line
        assert line.startswith(f"openarc pull: {repo_id!r} is not a repository id such as "
                               f"OpenVINO/Qwen2.5-7B-Instruct-int4-ov: {rule}"), line
    assert not (tmp_path / "x").exists()


def test_an_unreachable_hub_is_one_clear_line(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    done = pull(tmp_path, endpoint, DEMO_REPOS["llm"], "--dir", str(tmp_path / "x"))
    assert time.monotonic() - started < 120  # no endless retrying
    assert done.returncode == 1
    assert done.stderr.strip() == (f"openarc pull: cannot reach the hub at {endpoint} ([Errno 111] Connection "
                                   "refused); check the network, or HF_ENDPOINT for a mirror")
    assert not (tmp_path / "x").exists()
