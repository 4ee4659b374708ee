"""Acceptance 2: greedy outputs equal Hugging Face generate, alone and all at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_greedy(hf_model, hf_tokenizer):
    """Reference continuations from transformers' own generate (same weights, float32)."""
    refs = []
    for q in QUESTIONS:
        ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        refs.append((ids, out[0, len(ids):].tolist()))
    return refs


def _ask(client, q):
    return client.chat([{"role": "user", "content": q}], max_tokens=MAX_TOKENS, temperature=0.0,
                       return_prompt_token_ids=True)


def test_greedy_matches_transformers_one_at_a_time(client, hf_greedy):
    for q, (prompt_ids, ref) in zip(QUESTIONS, hf_greedy):
        reply = _ask(client, q)
        assert list(reply.prompt_token_ids) == prompt_ids, q
        assert list(reply.choices[0].token_ids) == ref, q


def test_greedy_matches_transformers_all_at_once(client, hf_greedy):
    client.utility("flush_prefix_cache")
    _ask(client, QUESTIONS[0])  # warms the blocks of the shared system prompt
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        replies = list(pool.map(lambda q: _ask(client, q), QUESTIONS))
    for q, reply, (_, ref) in zip(QUESTIONS, replies, hf_greedy):
        assert list(reply.choices[0].token_ids) == ref, q
    # They share the chat template's system prompt: prefix sharing really happened.
    assert sum(r.usage.cached_prompt_tokens for r in replies) > 0
