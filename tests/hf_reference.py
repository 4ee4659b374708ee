"""transformers' own answer for a prompt: the reference every parity test compares against.

`hf_reference(hf, tokens, steps)` runs transformers' model greedily by full-sequence forwards (no
transformers cache, so nothing of ours or theirs is incremental) and memoises the answer per model
object and prompt. The memo is keyed weakly by the model itself: a key made of `id(hf)` would hand
a freed model's answer to a new model that happens to reuse its address (module-scoped fixtures
free one checkpoint before building the next).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch


@dataclasses.dataclass(frozen=True)
class Reference:
    """Greedy decoding of `steps` tokens after a prompt.

    continuation: the greedy tokens, `steps` of them.
    step_logits: `[steps, vocab]`, each step's last-position logits (float32), from the forward
        that chose that step's token.
    logits: `[len(prompt) + steps, vocab]`, every position's logits from one forward over prompt +
        continuation (float32).
    """

    continuation: list[int]
    step_logits: torch.Tensor
    logits: torch.Tensor

    @property
    def step_logprobs(self) -> torch.Tensor:
        return torch.log_softmax(self.step_logits, dim=-1)


def compute_reference(hf: torch.nn.Module, tokens: list[int], steps: int) -> Reference:
    """`Reference` computed afresh (forward hooks on `hf` see every forward)."""
    ids, rows = list(tokens), []
    with torch.no_grad():
        for _ in range(steps):
            row = hf(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            rows.append(row)
            ids.append(int(row.argmax()))
        logits = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    return Reference(ids[len(tokens):], torch.stack(rows), logits)


_MEMO: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[tuple[int, ...], int], Reference]] = (
    weakref.WeakKeyDictionary())


def hf_reference(hf: torch.nn.Module, tokens: list[int], steps: int) -> Reference:
    """`compute_reference`, memoised per model object, prompt and number of steps."""
    answers = _MEMO.setdefault(hf, {})
    key = (tuple(tokens), steps)
    if key not in answers:
        answers[key] = compute_reference(hf, tokens, steps)
    return answers[key]


def assert_logprobs_match(reference: Reference, tokens: list[int], logprobs: list, steps: int,
                          atol: float) -> None:
    """Our `steps` greedy tokens are transformers' and every sampled and top logprob is within
    `atol` of transformers' log-softmax at that step."""
    assert tokens == reference.continuation[:steps]
    assert len(logprobs) == steps
    for step, (lp, row) in enumerate(zip(logprobs, reference.step_logprobs)):
        assert lp is not None and lp.token_id == tokens[step]
        assert abs(lp.logprob - float(row[lp.token_id])) <= atol, f"step {step}"
        assert [t for t, _ in lp.top][:1] == [int(row.argmax())]
        for token_id, value in lp.top:
            assert abs(value - float(row[token_id])) <= atol, f"step {step} token {token_id}"
