"""The parity tests' memo of transformers' answers forgets a model when the model is freed, so a
later model (possibly at the freed one's address) gets its own answer."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import torch

from tests.hf_reference import _MEMO, hf_reference


class Bigram(torch.nn.Module):
    """A stand-in with transformers' call shape: logits depend only on the last token."""

    def __init__(self, shift: int, vocab: int = 11) -> None:
        super().__init__()
        self.shift, self.vocab = shift, vocab

    def forward(self, ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        nxt = (ids[0] + self.shift) % self.vocab
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, self.vocab).float()[None])


def test_answers_are_per_model_and_die_with_it() -> None:
    first = Bigram(shift=1)
    assert hf_reference(first, [3], 4).continuation == [4, 5, 6, 7]
    assert hf_reference(first, [3], 2).continuation == [4, 5]  # the step count is part of the key
    assert first in _MEMO
    del first
    gc.collect()
    assert len([m for m in _MEMO.keys() if isinstance(m, Bigram)]) == 0
    second = Bigram(shift=2)
    reference = hf_reference(second, [3], 4)
    assert reference.continuation == [5, 7, 9, 0]
    assert reference.logits.shape == (5, 11) and reference.step_logits.shape == (4, 11)
    assert reference.step_logits[0].argmax() == 5
