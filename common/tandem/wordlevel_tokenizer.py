"""A word-level tokenizer for a model that has none (dummy weights, benchmarks).

Token i is the word `t<i>`; text is split on whitespace, and an unknown word is token 0. It
covers a vocabulary of any size exactly, so every id a model can emit decodes, and every text
it encodes stays inside the model's vocabulary. Used by the engine for `dummy:` models whose
vocabulary is too small for the embedded tokenizer, and by the benchmarks. Needs the
`tokenizers` package (imported when called; the frontend and the engine both have it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


FORMAT_VERSION = 1  # part of the cached directory's name: a change to what is written gets a new one

# Messages' contents one after another, so a chat request works: each word of the vocabulary
# is its token, any other word the unknown token t0.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def write_wordlevel_tokenizer(directory: str | Path, vocab_size: int, eos_token_id: int | None,
                              max_model_len: int | None) -> Path:
    """Writes the tokenizer (`tokenizer.json`, `tokenizer_config.json`) into `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
                              "chat_template": CHAT_TEMPLATE}
    if eos_token_id is not None:
        config["eos_token"] = f"t{eos_token_id}"
    if max_model_len:
        config["model_max_length"] = max_model_len
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def cached_wordlevel_tokenizer(cache_root: str | Path, vocab_size: int, eos_token_id: int | None,
                               max_model_len: int | None) -> Path:
    """The word-level tokenizer for these parameters under `cache_root/tokenizers/`, written on
    first use into a temporary sibling and renamed into place, so processes that ask at the
    same time (two engines of one `serve --disaggregated`) never see a half-written one."""
    root = Path(cache_root).expanduser() / "tokenizers"
    target = root / f"wordlevel{FORMAT_VERSION}-v{vocab_size}-eos{eos_token_id}-len{max_model_len}"
    if (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        write_wordlevel_tokenizer(tmp, vocab_size, eos_token_id, max_model_len)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "tokenizer.json").is_file():  # not another process winning the rename
            raise
    return target
