"""Prompt logprobs (vLLM's `prompt_logprobs`), computed during prefill.

For every prompt position t >= 1: the logprob of the prompt's own token t under the model's
distribution after tokens 0 .. t-1, its rank (1 + the number of tokens with a strictly higher
logprob) and the `prompt_logprobs` most likely tokens; position 0 has none. The distribution is
the raw one (log-softmax of the logits as the model produced them), as for generated tokens.

The hidden state at position p predicts token p + 1, so a chunk that computes positions
[start, start + n) of a prompt of P tokens yields the logprobs of positions start + 1 ..
min(start + n, P - 1): a prompt chunked over several steps reports its positions chunk by chunk,
in order. (The last prompt position predicts the first output token: that is the sampler's.)
Each row remembers the last position it reported (`RequestRow.prompt_logprobs_done`), so a
request preempted and recomputed reports no position twice. Positions come only from computed
hidden states: a request asking for prompt logprobs takes no prefix-cache hits (block_manager).

Memory: logits are made `SLICE_TOKENS` positions at a time, so a long chunk never holds
`[chunk, vocab]` float logits at once; the results start their way to the host at once
(`HostCopy`), like the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.core_protocol import TokenLogprobs
from tandem.engine_service.worker.host_copy import HostCopy, values_to_device
from tandem.engine_service.worker.worker_rows import StepBatch

SLICE_TOKENS = 512


@dataclass
class PromptLogprobSpan:
    """Consecutive prompt positions of one request computed in this step: `token_ids` are the
    prompt's tokens at positions `first_position` .. (their logprobs are wanted), predicted by
    the hidden states at the step's flat token indices `flat_start` .. (one position earlier)."""

    request_id: str
    first_position: int
    flat_start: int
    token_ids: list[int]
    top_n: int


def take_prompt_logprob_spans(batch: StepBatch) -> list[PromptLogprobSpan]:
    """The spans this step's batch computes, in batch order; marks their positions reported
    on the rows (a launched step always completes or its request ends)."""
    spans: list[PromptLogprobSpan] = []
    offset = 0
    for row, n in zip(batch.rows, batch.num_scheduled_tokens):
        top_n = row.params.prompt_logprobs
        if top_n is not None:
            start = row.num_computed_tokens
            first = max(start + 1, row.prompt_logprobs_done + 1)
            last = min(start + n, row.num_prompt_tokens - 1)
            if last >= first:
                spans.append(PromptLogprobSpan(row.request_id, first, offset + first - 1 - start,
                                               row.token_ids[first:last + 1], top_n))
                row.prompt_logprobs_done = last
        offset += n
    return spans


def hidden_rows(spans: list[PromptLogprobSpan], device: torch.device) -> torch.Tensor:
    """The flat token indices whose hidden states the spans need, in span order."""
    idx = [i for s in spans for i in range(s.flat_start, s.flat_start + len(s.token_ids))]
    return values_to_device(idx, torch.long, device)


def compute_prompt_logprobs(hidden: torch.Tensor, spans: list[PromptLogprobSpan],
                            compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            vocab_size: int) -> PendingPromptLogprobs:
    """Queues the spans' logprobs on the device. `hidden`: the hidden states at
    `hidden_rows(spans)`; `compute_logits`: the model's head; columns from `vocab_size` on are
    padding and never reported."""
    device = hidden.device
    targets = values_to_device([t for s in spans for t in s.token_ids], torch.long, device)
    top_n = max(s.top_n for s in spans)
    chosen, ranks, top_vals, top_ids = [], [], [], []
    for lo in range(0, hidden.shape[0], SLICE_TOKENS):
        logprobs = torch.log_softmax(compute_logits(hidden[lo:lo + SLICE_TOKENS])[:, :vocab_size].float(), dim=-1)
        picked = logprobs.gather(1, targets[lo:lo + SLICE_TOKENS].unsqueeze(1))
        chosen.append(picked.squeeze(1))
        ranks.append((logprobs > picked).sum(dim=-1) + 1)
        if top_n > 0:
            vals, ids = torch.topk(logprobs, min(top_n, vocab_size), dim=-1)
            top_vals.append(vals)
            top_ids.append(ids)
    parts = [torch.cat(chosen), torch.cat(ranks)]
    if top_n > 0:
        parts += [torch.cat(top_vals), torch.cat(top_ids)]
    return PendingPromptLogprobs(spans, HostCopy(parts))


class PendingPromptLogprobs:
    """A step's prompt logprobs on their way to the host; `result()` per request, in order."""

    def __init__(self, spans: list[PromptLogprobSpan], copy: HostCopy) -> None:
        self.spans = spans
        self._copy = copy

    def result(self) -> dict[str, list[TokenLogprobs]]:
        host = self._copy.wait()
        chosen, ranks = host[0].tolist(), host[1].tolist()
        top_vals = host[2].tolist() if len(host) > 2 else None
        top_ids = host[3].tolist() if len(host) > 3 else None
        out: dict[str, list[TokenLogprobs]] = {}
        j = 0
        for span in self.spans:
            entries = out.setdefault(span.request_id, [])
            for token_id in span.token_ids:
                top = list(zip(top_ids[j][:span.top_n], top_vals[j][:span.top_n])) if span.top_n and top_ids else []
                entries.append(TokenLogprobs(token_id=token_id, logprob=chosen[j], rank=ranks[j], top=top))
                j += 1
        return out
