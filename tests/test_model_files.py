"""Detection of what a model directory is (appliance.model_files): a pure function of file names and config.json,
run on the demo models of every kind as built here, a VLM's file layout, and the repositories `openarc pull` refuses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from appliance import model_files
from appliance.model_files import detect, export_command, missing_ir, path_problem, read_dir
from conftest import run_as_nobody


@pytest.fixture(scope="module")
def demo_dirs(demo_model, embedding_model, rerank_model, demo_whisper):
    return {"llm": demo_model, "embedding": embedding_model, "rerank": rerank_model, "transcription": demo_whisper}


@pytest.mark.parametrize("kind", ["llm", "embedding", "rerank", "transcription"])
def test_each_demo_model_is_detected_as_its_kind(demo_dirs, kind):
    found = detect(*read_dir(demo_dirs[kind]))
    assert (found.format, found.kind) == ("openvino", kind), found
    assert path_problem(str(demo_dirs[kind]), kind) is None


def ir(*stems: str) -> set[str]:
    return {f"{stem}.{ext}" for stem in stems for ext in ("xml", "bin")}


TOKENIZERS = ir("openvino_tokenizer", "openvino_detokenizer")


def test_a_vlm_is_detected_by_its_three_models():
    files = ir("openvino_language_model", "openvino_vision_embeddings_model", "openvino_text_embeddings_model")
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {}}
    assert detect(files | TOKENIZERS | {"config.json"}, config).kind == "vlm"
    found = detect(ir("openvino_language_model") | TOKENIZERS, config)
    assert found.kind is None and "openvino_vision_embeddings_model.xml/.bin" in found.reason


@pytest.mark.parametrize("files, config, kind", [
    # Qwen3-Embedding: a CausalLM by architecture, an embedding model by its sentence-transformers modules.
    (ir("openvino_model", "openvino_tokenizer") | {"modules.json", "1_Pooling/config.json"},
     {"architectures": ["Qwen3ForCausalLM"]}, "embedding"),
    (ir("openvino_model", "openvino_tokenizer"), {"architectures": ["XLMRobertaForSequenceClassification"]}, "rerank"),
    (ir("openvino_model", "openvino_tokenizer"), {"architectures": ["XLMRobertaModel"]}, "embedding"),
    (ir("openvino_model") | TOKENIZERS, {"architectures": ["Qwen2ForCausalLM"]}, "llm"),
    (ir("openvino_model") | TOKENIZERS | {"generation_config.json"}, None, "llm"),
])
def test_kind_follows_config_json_and_sentence_transformers_files(files, config, kind):
    assert detect(files, config).kind == kind


def test_an_llm_without_its_detokenizer_is_incomplete():
    found = detect(ir("openvino_model", "openvino_tokenizer"), {"architectures": ["LlamaForCausalLM"]})
    assert found.is_openvino and found.kind is None
    assert found.reason == "an incomplete llm model: missing openvino_detokenizer.xml/.bin"


@pytest.mark.parametrize("files, config, fmt, kind", [
    ({"model.safetensors", "config.json", "tokenizer.json"}, {"architectures": ["Qwen2ForCausalLM"]}, "pytorch", "llm"),
    ({"model-00001-of-00002.safetensors", "modules.json"}, {"architectures": ["BertModel"]}, "pytorch", "embedding"),
    ({"pytorch_model.bin"}, {"architectures": ["WhisperForConditionalGeneration"]}, "pytorch", "transcription"),
    ({"qwen2.5-7b-instruct-q4_k_m.gguf", "README.md"}, None, "gguf", None),
    ({"README.md"}, None, "unknown", None),
])
def test_repositories_that_are_not_openvino_say_what_they_are(files, config, fmt, kind):
    found = detect(files, config)
    assert (found.format, found.kind, found.is_openvino) == (fmt, kind, False)


def test_the_export_command_has_the_task_and_weight_format_of_the_kind():
    assert export_command("Qwen/Qwen2.5-7B-Instruct", "llm", "qwen2.5-7b-ov") == (
        "optimum-cli export openvino --model Qwen/Qwen2.5-7B-Instruct --task text-generation-with-past "
        "--weight-format int4 qwen2.5-7b-ov")
    assert "--task feature-extraction --weight-format int8" in export_command("BAAI/bge-small-en-v1.5", "embedding", "o")
    assert "--task text-classification" in export_command("BAAI/bge-reranker-base", "rerank", "o")
    assert "--task automatic-speech-recognition-with-past" in export_command("openai/whisper-small", "transcription", "o")
    assert "--task image-text-to-text --weight-format int4" in export_command("Qwen/Qwen2-VL-2B-Instruct", "vlm", "o")
    assert "--task text-to-audio" in export_command("microsoft/speecht5_tts", "tts", "o")


def test_speech_synthesis_models_are_tts():
    speecht5 = {f"{stem}.{ext}" for stem in ("openvino_encoder_model", "openvino_decoder_model", "openvino_postnet",
                                             "openvino_vocoder", "openvino_tokenizer") for ext in ("xml", "bin")}
    assert detect(speecht5, {"architectures": ["SpeechT5ForTextToSpeech"]}).kind == "tts"
    missing = detect(speecht5 - {"openvino_vocoder.xml"}, {"architectures": ["SpeechT5ForTextToSpeech"]})
    assert missing.kind is None and "openvino_vocoder.xml/.bin" in missing.reason
    kokoro = {"openvino_model.xml", "openvino_model.bin", "voices/af_heart.bin"}
    assert detect(kokoro, {"vocab": {"a": 1}, "istftnet": {}}).kind == "tts"
    assert detect(kokoro, {"architectures": ["KModel"]}).kind is None  # neither SpeechT5 nor Kokoro


def test_path_problems_name_the_path_and_what_was_expected(tmp_path, demo_dirs):
    missing = tmp_path / "nope"
    assert path_problem(str(missing), "llm") == f"expected an OpenVINO model directory; {str(missing)!r} does not exist"
    (tmp_path / "file").write_text("x")
    assert "is a file" in path_problem(str(tmp_path / "file"), "llm")
    problem = path_problem(str(demo_dirs["embedding"]), "transcription")
    assert problem.startswith("expected an OpenVINO IR directory for kind 'transcription'")
    assert "openvino_encoder_model.xml/.bin" in problem and "it holds a model of kind 'embedding'" in problem
    assert missing_ir(read_dir(demo_dirs["llm"])[0], "llm") == []


@pytest.fixture
def private_weights(demo_dirs):
    """A copy of the chat demo model whose weights only root may read, in a directory every user can pass through
    (pytest's tmp dirs are private to root)."""
    shared = Path(tempfile.mkdtemp(prefix="openarc-model-files-"))
    shared.chmod(0o755)
    model = shared / "model"
    shutil.copytree(demo_dirs["llm"], model)
    model.chmod(0o755)
    (model / "openvino_model.bin").chmod(0o600)
    yield model
    shutil.rmtree(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another user")
def test_a_model_the_service_user_cannot_read_is_named(private_weights):
    model = private_weights
    nobody = model_files.service_user("nobody")
    # The permission bits say what the kernel says when that user opens the files.
    for name, readable in (("openvino_model.bin", False), ("openvino_tokenizer.bin", True)):
        assert (model_files.unreadable_by(model / name, *nobody) is None) is readable
        done = subprocess.run([sys.executable, "-c", f"open({str(model / name)!r}, 'rb').read(1)"],
                              user=65534, group=65534, capture_output=True, text=True, timeout=30)
        assert (done.returncode == 0) is readable, done.stderr
    assert path_problem(str(model), "llm", user_name="nobody") == (
        f"expected files the service user 'nobody' can read; it cannot read {str(model / 'openvino_model.bin')!r}")
    model.chmod(0o700)  # the directory itself closed: named before its files
    assert path_problem(str(model), "llm", user_name="nobody").endswith(f"cannot read {str(model)!r}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another user")
def test_as_the_serving_user_itself_unreadable_weights_are_named(private_weights):
    """The server's own check (no service user to look up: it is that user) asks the kernel."""
    model = private_weights
    done = run_as_nobody("from appliance.model_files import path_problem; "
                         f"print(path_problem({str(model)!r}, 'llm', user_name=None)); "
                         "print(path_problem('/root/openarc-no-such-model', 'llm', user_name=None))", "model_files")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"expected files this user can read; cannot read {str(model / 'openvino_model.bin')!r}",
        "expected a directory this user can read; cannot reach '/root/openarc-no-such-model' (Permission denied)"]
