"""Where the tokenizer of a model spec lives, as a local directory the frontend can load.

A model directory (converted GGUF, Hugging Face snapshot, local folder) holds its own tokenizer
files. Dummy weights have none, so a `dummy:` model gets one that fits its vocabulary:

- the embedded SmolLM2 tokenizer (`EMBEDDED_TOKENIZER`, from the embedded model's converted
  directory) when the vocabulary holds all of its ids and the embedded model's package is
  installed, so chat templates and real text work;
- otherwise a word-level tokenizer built to exactly the configuration's vocabulary size
  (`tandem.wordlevel_tokenizer`), so no prompt can carry an id the model does not have.

The engine reports the directory in its model info (`tokenizer_path`); `--tokenizer` takes
every `--model` form and resolves through `tokenizer_dir` too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EMBEDDED_TOKENIZER = "smollm2-135m-instruct"
EMBEDDED_VOCAB_SIZE = 49152  # SmolLM2's tokenizer: ids 0..49151


def dummy_tokenizer_dir(config: dict[str, Any], cache_dir: str | None = None) -> Path:
    """The tokenizer directory of dummy model `config` (see the module docstring)."""
    from tandem.engine_service.worker.loader import (ResolvedModel, default_cache_root, read_eos_token_ids,
                                                     resolve_model)
    from tandem.model_spec import embedded_model_installed
    from tandem.wordlevel_tokenizer import cached_wordlevel_tokenizer

    vocab = int(config["vocab_size"])
    if vocab >= EMBEDDED_VOCAB_SIZE and embedded_model_installed(EMBEDDED_TOKENIZER):
        return Path(resolve_model(EMBEDDED_TOKENIZER, cache_dir).path)
    # A vocabulary too small for the embedded tokenizer, or an install without the embedded model
    # package (a GPU host given only the engine): a word-level tokenizer of exactly this size.
    eos = read_eos_token_ids(ResolvedModel(path=None, config=config, is_dummy=True))
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    return cached_wordlevel_tokenizer(root, vocab, eos[0] if eos else None, config.get("max_position_embeddings"))


def tokenizer_dir(spec: str, cache_dir: str | None = None) -> Path:
    """The tokenizer directory of any `--model` spec (converting a GGUF file on first use)."""
    from tandem.engine_service.worker.loader import resolve_model

    resolved = resolve_model(spec, cache_dir)
    if resolved.path is None:
        return dummy_tokenizer_dir(resolved.config, cache_dir)
    return Path(resolved.path)
