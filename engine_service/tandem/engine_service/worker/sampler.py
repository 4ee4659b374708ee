"""Turns one step's logits into one token per sequence, with optional logprobs.

Processing order for every row (vectorised across the batch, per-row parameters as tensors):

1. ``min_tokens``: while a sequence has fewer than ``min_tokens`` outputs, the tokens that would
   stop it (its EOS ids unless ``ignore_eos``, and its ``stop_token_ids``) are masked to -inf.
2. Repetition penalty (Hugging Face semantics) over prompt + output tokens, then presence and
   frequency penalties (OpenAI semantics) over output tokens only. Greedy rows get them too.
3. Structured output: a step whose plan carries a `TokenBitmask` masks to -inf, on the device,
   every token its constrained rows' matchers do not allow (`apply_token_bitmask`). A step
   without one runs none of this: not a branch more than before per row.
4. Greedy rows (temperature == 0) take the argmax here. Other rows go on: temperature, top-k,
   top-p (relative to the top-k-truncated distribution, as Hugging Face and vLLM do), min-p,
   then one draw with the exponential race ``argmax(probs / q), q ~ Exp(1)``.

The top-k / top-p / min-p filter is one function with two implementations: on CUDA the sort-free
Triton kernel ``tandem.kernels.sampling.apply_top_k_top_p_min_p`` when some row uses top-p or
min-p (a batch whose rows use top-k alone keeps the partial ``topk``, which was faster on an H200:
bench/NOTES.md), elsewhere its PyTorch twin (a partial ``topk`` when no row uses top-p, else the
kernel's sort-based reference). Both keep the
same set: a token tied with a kept token is kept (top-k keeps every logit equal to the k-th;
top-p keeps token i iff the mass of strictly more likely survivors is < p), so the result does
not depend on the order a sort gives equal logits. They differ only by float rounding of a
token whose probability lies exactly on a boundary.

Logprobs describe the *raw* model distribution: log-softmax of the logits as the model produced
them, before min_tokens masking, penalties or temperature (vLLM's default ``raw_logprobs`` mode).
They are computed only for rows whose request asked for them.

Randomness: a seeded sequence draws its noise on CPU from the row's own ``generator`` alone, one
``[V]`` draw per sampled token, so its tokens do not depend on batch size, batch position or the
other requests. Unseeded rows share the sampler's own generator, on the logits' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

import numpy as np

from tandem.core_protocol import LOGIT_BAN, SamplingParams, TokenLogprobs
from tandem.engine_service.step_plan import TokenBitmask
from tandem.engine_service.worker.host_copy import HostCopy
from tandem.engine_service.worker.host_copy import pinned_to_device as _host_to_device
from tandem.engine_service.worker.host_copy import values_to_device as _to_device
from tandem.kernels.sampling import apply_top_k_top_p_min_p, apply_top_k_top_p_min_p_reference


class SamplingRow(Protocol):
    """What the sampler reads of a request: the worker's `RequestRow` (or, in tests, a `Sequence`)."""

    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None

    @property
    def num_generated_tokens(self) -> int: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class SamplerOutput:
    """One sampled token per input row, and its logprobs (None where the row did not ask)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples the next token of every sequence in a batch from its logits row.

    ``vocab_size``: the real vocabulary size. When given, logits columns at or beyond it are
    padding (lm heads are often padded to a multiple of 64/128) and are never sampled nor
    reported in logprobs. ``seed`` seeds the generator shared by unseeded rows (None: random).
    ``filter_kernel``: run top-p / min-p batches through the Triton kernel (True; on CPU only
    under ``TRITON_INTERPRET=1``, for tests) or everything through the PyTorch twin (False); None
    picks the kernel on CUDA when Triton is installed. Either way the noise, and so per-request
    seeding, is the same.
    """

    def __init__(self, vocab_size: int | None = None, seed: int | None = None,
                 filter_kernel: bool | None = None) -> None:
        if vocab_size is not None and vocab_size < 1:
            raise ValueError("vocab_size must be >= 1")
        self.vocab_size = vocab_size
        self._seed = seed
        self._filter_kernel = filter_kernel
        self._generators: dict[torch.device, torch.Generator] = {}

    # -- public entry points -----------------------------------------------------------------
    def sample(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SamplerOutput:
        """Sample and wait for the result on the host."""
        return self.sample_async(logits, seqs).result()

    def sample_async(self, logits: torch.Tensor, seqs: list[SamplingRow],
                     bitmask: TokenBitmask | None = None) -> PendingSample:
        """Queue the sampling on the logits' device and start copying the result to the host;
        returns without waiting (no host sync on CUDA). `seqs` are read now, not later.
        `bitmask`: the allowed tokens of the structured-output rows (step_plan.TokenBitmask)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(seqs)} sequences")
        if self.vocab_size is not None:
            if logits.shape[1] < self.vocab_size:
                raise ValueError(f"logits have {logits.shape[1]} columns, vocab_size is {self.vocab_size}")
            logits = logits[:, : self.vocab_size]
        raw = logits.float()
        params = [s.params for s in seqs]
        device = raw.device
        if not seqs:
            return PendingSample(torch.zeros(0, dtype=torch.long, device=device), None, params)

        work = _apply_logit_bias(self._apply_logit_masks_and_penalties(raw, seqs), raw, seqs)
        if bitmask is not None:
            work = _apply_plan_bitmask(work, raw, bitmask)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            tokens = work.argmax(dim=-1)
        elif not greedy_rows:
            tokens = self._sample_random(work, seqs)
        else:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=device)
            g_idx = _to_device(greedy_rows, torch.long, device)
            r_idx = _to_device(random_rows, torch.long, device)
            tokens[g_idx] = work[g_idx].argmax(dim=-1)
            tokens[r_idx] = self._sample_random(work[r_idx], [seqs[i] for i in random_rows])

        return PendingSample(tokens, self._logprob_tensors(raw, tokens, params), params)

    # -- logit processing shared by greedy and random rows -----------------------------------
    def _apply_logit_masks_and_penalties(self, raw: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        """min_tokens masking and penalties; returns ``raw`` itself when nothing applies."""
        batch, vocab = raw.shape
        device = raw.device
        work = raw

        mask_rows: list[int] = []
        mask_cols: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_generated_tokens < p.min_tokens:
                stoppers = list(p.stop_token_ids)
                if not p.ignore_eos:
                    stoppers.extend(seq.eos_token_ids)
                for t in stoppers:
                    if 0 <= t < vocab:
                        mask_rows.append(i)
                        mask_cols.append(t)
        if mask_rows:
            work = work.clone()
            work[_to_device(mask_rows, torch.long, device), _to_device(mask_cols, torch.long, device)] = -math.inf

        params = [s.params for s in seqs]
        use_rep = [p.uses_repetition_penalty for p in params]
        use_freq_pres = [p.uses_output_penalties for p in params]
        if not any(use_rep) and not any(use_freq_pres):
            return work
        if work is raw:
            work = raw.clone()

        # Output-token counts serve all three penalties; prompt tokens only the repetition one.
        out_counts = _token_counts(
            [s.output_token_ids if (r or f) else [] for s, r, f in zip(seqs, use_rep, use_freq_pres)],
            vocab,
            device,
        )
        if any(use_rep):
            prompt_counts = _token_counts(
                [s.prompt_token_ids if r else [] for s, r in zip(seqs, use_rep)], vocab, device
            )
            seen = (prompt_counts + out_counts) > 0
            penalty = _column([p.repetition_penalty for p in params], device)
            penalised = torch.where(work > 0, work / penalty, work * penalty)
            work = torch.where(seen, penalised, work)
        if any(use_freq_pres):
            presence = _column([p.presence_penalty for p in params], device)
            frequency = _column([p.frequency_penalty for p in params], device)
            work = work - presence * (out_counts > 0).to(work.dtype) - frequency * out_counts
        return work

    # -- the non-greedy path -----------------------------------------------------------------
    def _sample_random(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one exponential-race draw per row."""
        params = [s.params for s in seqs]
        device = logits.device
        vocab = logits.shape[1]
        logits = logits / _column([p.temperature for p in params], device)
        logits = _filter_top_k_top_p_min_p(logits, params, self._use_filter_kernel(device))

        probs = logits.softmax(dim=-1)
        q = self._exponential_noise(seqs, vocab, device)
        # exponential_ may return exactly 0; 0/0 would be NaN and argmax would pick a masked token.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    def _exponential_noise(self, seqs: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
        seeded = [i for i, s in enumerate(seqs) if s.generator is not None]
        q = torch.empty(len(seqs), vocab, dtype=torch.float32, device=device)
        if len(seeded) < len(seqs):
            gen = self._generator(device)
            if not seeded:
                q.exponential_(generator=gen)
            else:
                unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
                noise = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=device)
                q[_to_device(unseeded, torch.long, device)] = noise.exponential_(generator=gen)
        if seeded:
            # One CPU draw of exactly [vocab] per seeded row keeps its stream batch-independent.
            rows = [torch.empty(vocab, dtype=torch.float32).exponential_(generator=seqs[i].generator) for i in seeded]
            q[_to_device(seeded, torch.long, device)] = _host_to_device(torch.stack(rows), device)
        return q

    def _use_filter_kernel(self, device: torch.device) -> bool:
        if self._filter_kernel is not None:
            return self._filter_kernel
        if device.type != "cuda":
            return False
        from tandem.kernels._utils import triton_available

        return triton_available()

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    # -- logprobs ----------------------------------------------------------------------------
    @staticmethod
    def _logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> _LogprobTensors | None:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        idx = _to_device(rows, torch.long, raw.device)
        logprobs = torch.log_softmax(raw[idx], dim=-1)
        chosen_lp = logprobs.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
        top_n = min(max(params[i].logprobs or 0 for i in rows), raw.shape[1])
        top_vals = top_ids = None
        if top_n > 0:
            top_vals, top_ids = torch.topk(logprobs, top_n, dim=-1)
        return _LogprobTensors(rows, chosen_lp, ranks, top_vals, top_ids)


@dataclass
class _LogprobTensors:
    """Logprob results of the rows in `rows` (device tensors until `PendingSample` copies them)."""

    rows: list[int]
    chosen: torch.Tensor  # [R] float
    ranks: torch.Tensor  # [R] long
    top_vals: torch.Tensor | None  # [R, top_n] or None when no row asked for alternatives
    top_ids: torch.Tensor | None


class PendingSample:
    """One step's sampled tokens on their way to the host.

    `token_ids` stays on the device: the next step's pending inputs read it there. The host copy
    (tokens and logprob results) is started at construction, asynchronously into pinned memory
    on CUDA; `result()` waits for that copy only — not for later work queued on the device.
    """

    def __init__(self, token_ids: torch.Tensor, logprobs: _LogprobTensors | None, params: list[SamplingParams]) -> None:
        self.token_ids = token_ids
        self._params = params
        self._logprob_rows = logprobs.rows if logprobs is not None else []
        parts = [token_ids]
        if logprobs is not None:
            parts += [logprobs.chosen, logprobs.ranks]
            if logprobs.top_vals is not None:
                parts += [logprobs.top_vals, logprobs.top_ids]
        self._copy = HostCopy(parts)
        self._result: SamplerOutput | None = None

    def ready(self) -> bool:
        """Whether `result()` would return without waiting."""
        return self._copy.ready()

    def result(self) -> SamplerOutput:
        if self._result is None:
            self._result = self._build(self._copy.wait())
        return self._result

    def _build(self, host: list[torch.Tensor]) -> SamplerOutput:
        token_ids = host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self._logprob_rows:
            chosen, ranks = host[1].tolist(), host[2].tolist()
            top_vals = host[3].tolist() if len(host) > 3 else None
            top_ids = host[4].tolist() if len(host) > 4 else None
            for j, i in enumerate(self._logprob_rows):
                n = self._params[i].logprobs or 0
                top = list(zip(top_ids[j][:n], top_vals[j][:n])) if n > 0 and top_ids is not None else []
                logprobs[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen[j], rank=ranks[j], top=top)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


# -- helpers -----------------------------------------------------------------------------------
def _apply_logit_bias(work: torch.Tensor, raw: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """Adds each row's `logit_bias` to its logits (a bias of LOGIT_BAN makes the logit -inf, so
    the token is never sampled, whatever its logit). One sparse scatter for the batch; `work`
    itself when no row has a bias (`raw`, the logprobs' source, is never written)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = work.shape[1]
    for i, seq in enumerate(seqs):
        for token, bias in seq.params.logit_bias.items():
            if 0 <= token < vocab:
                rows.append(i)
                cols.append(token)
                values.append(-math.inf if bias <= LOGIT_BAN else bias)
    if not rows:
        return work
    if work is raw:
        work = raw.clone()
    device = work.device
    work.index_put_((_to_device(rows, torch.long, device), _to_device(cols, torch.long, device)),
                    _to_device(values, work.dtype, device), accumulate=True)
    return work


def _apply_plan_bitmask(work: torch.Tensor, raw: torch.Tensor, bitmask: TokenBitmask) -> torch.Tensor:
    """`work` with the plan's token bitmask applied (a copy when `work` is `raw`, which the
    logprobs read): the packed words travel to the device (pinned, asynchronous), are unpacked
    there and mask the constrained rows."""
    if work is raw:
        work = raw.clone()
    device = work.device
    words = torch.from_numpy(np.frombuffer(bitmask.words, dtype="<i4").reshape(len(bitmask.rows), bitmask.num_words).copy())
    apply_token_bitmask(work, _to_device(bitmask.rows, torch.long, device), _host_to_device(words, device))
    return work


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}  # int32 1 << k for k in 0..31 (bit 31 is the sign)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """In place: for each i, `logits[rows[i], t] = -inf` for every token t whose bit
    (t % 32 of int32 word t // 32 of `words[i]`) is 0. All device ops, no host sync; `words`
    may cover more ids than `logits` has columns (the padding bits are ignored)."""
    device = logits.device
    bits = _BIT_VALUES.get(device)
    if bits is None:
        bits = _BIT_VALUES[device] = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32,
                                                  device=device)
    vocab = logits.shape[1]
    allowed = ((words.unsqueeze(-1) & bits) != 0).reshape(words.shape[0], -1)[:, :vocab]
    if allowed.shape[1] < vocab:
        raise ValueError(f"a bitmask of {allowed.shape[1]} ids for logits of {vocab} columns")
    logits[rows] = logits[rows].masked_fill(~allowed, -math.inf)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _to_device(values, torch.float32, device).unsqueeze(1)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float counts of each token id per row.

    Rows are padded with the id ``vocab``, which lands in an extra column that is dropped; ids
    outside the logits' vocabulary are clamped into that same column and so ignored.
    """
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.long)
    padded = _host_to_device(padded.clamp_(min=0, max=vocab), device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _filter_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams], use_kernel: bool) -> torch.Tensor:
    """Mask to -inf what top-k, top-p and min-p remove (module docstring: the kept set).

    With `use_kernel`, a batch where some row uses top-p or min-p runs the kernel over every row
    in place (rows without a filter pass through unchanged). Otherwise the PyTorch twin works on
    the filtered rows only and sorts only when one of them uses top-p.
    """
    vocab = logits.shape[1]
    device = logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    ps = [p.top_p for p in params]
    min_ps = [max(p.min_p, 0.0) for p in params]
    rows = [i for i in range(len(params)) if ks[i] or ps[i] < 1.0 or min_ps[i] > 0.0]
    if not rows:
        return logits
    if use_kernel and (any(p < 1.0 for p in ps) or any(min_ps)):
        return apply_top_k_top_p_min_p(
            logits,
            _to_device(ks, torch.int32, device) if any(ks) else None,
            _to_device(ps, torch.float32, device) if any(p < 1.0 for p in ps) else None,
            _to_device(min_ps, torch.float32, device) if any(min_ps) else None,
            out=logits,
        )
    idx = _to_device(rows, torch.long, device)
    sub = logits[idx]
    k = _to_device([ks[i] for i in rows], torch.long, device)
    min_p = _to_device([min_ps[i] for i in rows], torch.float32, device)
    if any(ps[i] < 1.0 for i in rows):
        sub = apply_top_k_top_p_min_p_reference(sub, k, _to_device([ps[i] for i in rows], torch.float32, device), min_p)
    else:
        if any(ks[i] for i in rows):
            # Top-k alone: a partial topk gives each row's k-th value as a threshold, no full sort.
            kth = torch.topk(sub, max(ks[i] for i in rows), dim=-1).values.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))
            sub = sub.masked_fill((sub < kth) & (k > 0).unsqueeze(1), -math.inf)
        if any(min_ps[i] > 0.0 for i in rows):
            # p_i >= min_p * p_max  <=>  exp(logit_i - logit_max) >= min_p (the kernel's form).
            ratio = torch.exp(sub - sub.max(dim=-1, keepdim=True).values)
            sub = sub.masked_fill(ratio < min_p.unsqueeze(1), -math.inf)
    if len(rows) == len(params):
        return sub
    out = logits.clone()
    out[idx] = sub
    return out
