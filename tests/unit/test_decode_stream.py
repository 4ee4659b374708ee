"""StreamDetokenizer (DecodeStream, IncrementalDetokenizer fallback) against the tokenizer's own
decode and against IncrementalDetokenizer, on the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tandem.frontend.decode_stream import StreamDetokenizer, new_detokenizer, stream_backend
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.frontend.tokenizer import TextTokenizer

ENGLISH = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, a city of art. " * 3
CORPUS = [
    ENGLISH,
    "你好，世界！这是一个测试。日本語のテキストも少し。한국어 문장도 있습니다.",
    "Emoji: 🙂👍🏽🚀🎉 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and ✨ sparkles ✨.",
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)  # 🐍\n\n",
    "Mixed: x²+y²=z², €100, ½ cup, “quotes” — and ‘more’… café naïve straße.",
]


@pytest.fixture(scope="module")
def smol(smollm2_dir) -> TextTokenizer:
    return TextTokenizer.from_pretrained(smollm2_dir)


def _run(detok, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice((1, 1, 1, 2, 3, 5))
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_streams_equal_the_full_decode_and_the_python_window(smol, seed, skip):
    rng = random.Random(seed)
    prompt = smol.encode(rng.choice(CORPUS)[: rng.randint(1, 40)], add_special_tokens=False)
    text = "".join(rng.sample(CORPUS, 3))
    output = smol.encode(text, add_special_tokens=False)
    if rng.random() < 0.5:  # a special token inside the output (a chat marker) and EOS at its end
        output.insert(rng.randrange(len(output)), smol.eos_token_ids[0])
        output.append(smol.eos_token_ids[0])
    fast = StreamDetokenizer(smol, stream_backend(smol), prompt, skip_special_tokens=skip)
    slow = IncrementalDetokenizer(smol, prompt, skip_special_tokens=skip)
    fast_text = "".join(_run(fast, output, random.Random(seed)))
    slow_text = "".join(_run(slow, output, random.Random(seed)))
    whole = smol.decode(prompt + output, skip_special_tokens=skip)[len(smol.decode(prompt, skip_special_tokens=skip)):]
    assert fast_text == slow_text == whole
    assert fast.text == fast_text


def test_plain_text_stays_on_decode_stream(smol):
    detok = new_detokenizer(smol, smol.encode("Hello", add_special_tokens=False))
    assert isinstance(detok, StreamDetokenizer)
    ids = smol.encode(ENGLISH, add_special_tokens=False)
    deltas = [detok.push([t]) for t in ids]
    assert all(deltas) and not detok.on_fallback  # every token's text at once, no Python window
    assert "".join(deltas) + detok.flush() == smol.decode(ids)


def test_a_split_character_hands_over_to_the_window(smol):
    ids = smol.encode("fox 🚀 done", add_special_tokens=False)
    detok = StreamDetokenizer(smol, stream_backend(smol))
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert detok.on_fallback
    assert "".join(deltas) == "fox 🚀 done"
    assert all("\ufffd" not in d for d in deltas)  # no half character ever leaves


def test_truncated_character_is_flushed_as_replacement(smol):
    ids = smol.encode("a🚀", add_special_tokens=False)[:-1]  # the rocket's last byte never comes
    detok = new_detokenizer(smol)
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == smol.decode(ids)


def test_tokenizers_whose_decode_differs_keep_the_python_window(smollm2_dir):
    cleaned = AutoTokenizer.from_pretrained(smollm2_dir, clean_up_tokenization_spaces=True)
    tok = TextTokenizer(cleaned, kind="fast", probe_passed=True)
    assert stream_backend(tok) is None
    assert isinstance(new_detokenizer(tok), IncrementalDetokenizer)


def test_push_after_flush_names_the_misuse(smol):
    detok = new_detokenizer(smol)
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.push([1])


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory) -> TextTokenizer:
    """A SentencePiece-style fast tokenizer (Metaspace, byte fallback, a decoder that strips the
    first token's leading space), trained on Latin text so CJK and emoji become byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=[f"<0x{b:02X}>" for b in range(256)])
    raw.train_from_iterator([ENGLISH, CORPUS[4]] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 clean_up_tokenization_spaces=False)
    d = tmp_path_factory.mktemp("sp-tokenizer")
    hf.save_pretrained(d)
    return TextTokenizer.from_pretrained(d)


def test_sentencepiece_streams_match_the_python_window(sp_tok):
    assert stream_backend(sp_tok) is not None
    corpus = sp_tok.encode("\n".join(CORPUS), add_special_tokens=False)
    rng = random.Random(3)
    for _ in range(200):
        split = rng.randrange(1, len(corpus) - 1)
        prompt = corpus[max(0, split - rng.randint(0, 20)):split]
        out = corpus[split:split + rng.randint(1, 40)]
        seed = rng.random()
        fast = "".join(_run(StreamDetokenizer(sp_tok, stream_backend(sp_tok), prompt), out, random.Random(seed)))
        slow = "".join(_run(IncrementalDetokenizer(sp_tok, prompt), out, random.Random(seed)))
        assert fast == slow, (prompt, out)
