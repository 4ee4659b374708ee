"""Structured output inside the engine, on CPU: the token bitmask as the sampler applies it, the
matcher's rollback and replay, the embedded SmolLM2 constrained through preemptions with overlap
on, and the unconstrained path unchanged by it (tokens identical with and without constrained
neighbours, and with and without an all-allowing mask)."""

from __future__ import annotations

import json
import math

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from tandem.core_protocol import SamplingParams, StopGrammar, StructuredOutput, StructuredOutputKind
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.grammar.bitmask import fill_bitmask, num_words
from tandem.engine_service.grammar.compiler import load_vocabulary
from tandem.engine_service.grammar.matcher import GrammarMatcher
from tandem.engine_service.sequence import FinishReason, Sequence
from tandem.engine_service.step_plan import TokenBitmask
from tandem.engine_service.worker.sampler import Sampler, apply_token_bitmask
from tandem.structured_output import grammar_text

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
JSON = StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=json.dumps(SCHEMA))


def test_bitmask_masks_exactly_the_cleared_bits() -> None:
    vocab = 70  # three words, the last one partly padding
    rng = np.random.default_rng(0)
    bits = rng.random((2, 96)) < 0.5
    words = np.zeros((2, 3), dtype=np.uint32)
    for r in range(2):
        for t in range(96):
            if bits[r, t]:
                words[r, t // 32] |= np.uint32(1 << (t % 32))
    logits = torch.randn(4, vocab)
    before = logits.clone()
    apply_token_bitmask(logits, torch.tensor([3, 1]), torch.from_numpy(words.view(np.int32)))
    for row, r in ((3, 0), (1, 1)):
        for t in range(vocab):
            assert logits[row, t].item() == (before[row, t].item() if bits[r, t] else -math.inf)
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # rows without a mask untouched


def test_all_allowing_mask_changes_no_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams(temperature=0.0) for i in range(6)]

    class Row:
        def __init__(self, p):
            self.params, self.eos_token_ids = p, (0,)
            self.generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            self.num_generated_tokens, self.prompt_token_ids, self.output_token_ids = 0, [1], []

    plain = Sampler(vocab_size=100, seed=1).sample(logits, [Row(p) for p in params]).token_ids
    full = TokenBitmask(rows=[1, 2, 5], num_words=num_words(100), words=np.full((3, 4), -1, np.int32).tobytes())
    masked = Sampler(vocab_size=100, seed=1).sample_async(logits, [Row(p) for p in params], bitmask=full).result()
    assert masked.token_ids == plain
    only = TokenBitmask(rows=[0], num_words=4, words=np.array([[0, 0, 1 << 2, 0]], np.int32).tobytes())
    assert Sampler(vocab_size=100).sample_async(logits, [Row(p) for p in params], bitmask=only).result().token_ids[0] == 66


@pytest.fixture(scope="module")
def vocabulary(smollm2_dir):
    return load_vocabulary(smollm2_dir, 49152, (2,))


def test_matcher_rolls_back_and_replays(vocabulary) -> None:
    compiled = llguidance.LLMatcher(vocabulary, grammar_text(JSON), log_level=0)
    ids = vocabulary.tokenize_str('{"name":"Ann","age":3,"color":"red"}')
    m = GrammarMatcher(compiled.deep_copy())
    for t in ids[:5]:
        assert m.accept(t)
    mask_at_5 = fill_bitmask([m], 49152).copy()
    for t in ids[5:8]:
        assert m.accept(t)
    m.sync(ids[:5])  # a shorter history: rolled back
    assert m.tokens == ids[:5]
    assert np.array_equal(fill_bitmask([m], 49152), mask_at_5)
    m.sync(ids)  # replayed to the end: complete
    assert m.tokens == ids and m.is_terminated and not m.is_error
    other = vocabulary.tokenize_str('{"name":"Bo","age":7,"color":"blue"}')
    m.sync(other)  # diverged after the common prefix: rolled back to it, the rest replayed
    assert m.tokens == other and m.is_terminated
    allowed = fill_bitmask([m], 49152)[0]
    assert [t for t in range(49152) if (allowed[t // 32] >> (t % 32)) & 1] == [2]  # only EOS after "}"


def test_rejected_token_ends_the_request_with_an_error(vocabulary) -> None:
    from tandem.engine_service.core.stopping import check_stop

    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=10, structured_output=JSON))
    seq.grammar = GrammarMatcher(llguidance.LLMatcher(vocabulary, grammar_text(JSON), log_level=0))
    bad = vocabulary.tokenize_str("hello")[0]
    seq.append_token(bad)
    assert not seq.grammar.accept(bad)
    assert check_stop(seq, 100)
    assert seq.finish_reason == FinishReason.ERROR and "left the constraint" in seq.stop_reason.detail


SMALL = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["color", "n"], "additionalProperties": False}
SMALL_JSON = StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=json.dumps(SMALL))


def _engine(smollm2_dir, overlap: str, num_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(model=str(smollm2_dir), max_model_len=256),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, overlap_scheduling=overlap),
    ))


def _run(engine: LLMEngine, requests) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: dict = {rid: [[], None] for rid, _, _ in requests}
    steps = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            if o.finished:
                out[o.request_id][1] = (o.finish_reason, o.stop_reason)
        steps += 1
        assert steps < 3000
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.block_manager.num_used_blocks == 0
    return out


PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3057, 28, 7018, 411, 407, 19712, 8182, 2, 198,
          1, 4093, 198, 37815, 253, 1673, 347, 19255, 30, 2, 198, 1, 520, 9531, 198]


@pytest.mark.usefixtures("one_torch_thread")
def test_constrained_through_preemption_with_overlap(smollm2_dir, hf_tokenizer) -> None:
    # Blocks of 4 tokens, 12 of them: three requests of 9 + ~12 tokens cannot all stay resident,
    # so the scheduler preempts (recompute) while their matchers are mid-object.
    engine = LLMEngine(EngineConfig(
        ModelConfig(model=str(smollm2_dir), max_model_len=64),
        CacheConfig(block_size=4, num_blocks=12),
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, overlap_scheduling="on"),
    ))
    requests = [(f"c{i}", PROMPT[-9:], SamplingParams(max_tokens=30, temperature=1.0, seed=i,
                                                       structured_output=SMALL_JSON)) for i in range(3)]
    out = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for rid, (tokens, ending) in out.items():
        assert ending == (FinishReason.STOP, StopGrammar()), rid
        jsonschema.validate(json.loads(hf_tokenizer.decode(tokens)), SMALL)


@pytest.mark.usefixtures("one_torch_thread")
def test_unconstrained_tokens_unchanged_beside_constrained_ones(smollm2_dir) -> None:
    """On/off equivalence: seeded unconstrained requests give the same tokens alone (no
    structured-output work in any step) as beside a constrained one (masks in the plans, the
    step in flight finished before constrained steps)."""
    plain = [(f"p{i}", PROMPT[-8 - i:], SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i, ignore_eos=True))
             for i in range(2)]
    engine = _engine(smollm2_dir, "on", num_blocks=32)
    alone = _run(engine, plain)
    constrained = [("c", PROMPT[-9:], SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                     structured_output=SMALL_JSON))]
    mixed = _run(engine, plain + constrained)
    assert mixed["c"][1] is not None
    for rid, _, _ in plain:
        assert mixed[rid] == alone[rid], rid


def test_a_compiling_request_waits_aside_and_holds_up_nobody() -> None:
    """The scheduler keeps a request whose matcher compiles out of the queue (others are admitted
    meanwhile), admits it with its matcher once compiled, ends a failed compilation with
    invalid_structured_output, and cancels a compilation on abort or an expired deadline."""
    from concurrent.futures import Future

    from tandem.core_protocol import SchedulerReason
    from tandem.engine_service.cache.block_manager import BlockManager
    from tandem.engine_service.core.scheduler import Scheduler
    from tandem.engine_service.sequence import SequenceStatus

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(32, 4, False), 64)
    clock = [100.0]
    sched._clock = lambda: clock[0]
    params = SamplingParams(max_tokens=4, structured_output=SMALL_JSON)
    slow, bad, gone, late = (Future() for _ in range(4))
    seqs = {rid: Sequence(rid, [1, 2, 3], params, deadline=101.0 if rid == "late" else None)
            for rid in ("slow", "bad", "gone", "late")}
    for rid, fut in zip(seqs, (slow, bad, gone, late)):
        sched.add_compiling(seqs[rid], fut)
    plain = Sequence("plain", [4, 5, 6], SamplingParams(max_tokens=4))
    sched.add(plain)
    assert sched.num_waiting == 5 and sched.has_work()
    out = sched.schedule()
    assert [item.seq.request_id for item in out.scheduled] == ["plain"]  # not behind the compiling ones
    matcher = object()
    slow.set_result(matcher)
    bad.set_exception(ValueError("unknown name"))
    assert sched.abort("gone") is seqs["gone"] and gone.cancelled()
    clock[0] = 102.0  # past late's deadline
    out = sched.schedule()
    assert "slow" in [item.seq.request_id for item in out.scheduled] and seqs["slow"].grammar is matcher
    ended = {seq.request_id: seq.stop_reason.reason for seq in out.finished}
    assert ended == {"bad": SchedulerReason.INVALID_STRUCTURED_OUTPUT, "late": SchedulerReason.DEADLINE_EXCEEDED}
    assert "unknown name" in seqs["bad"].stop_reason.detail and late.cancelled()
    assert not sched.compiling and seqs["slow"].status is SequenceStatus.RUNNING


def test_a_tokenizer_without_byte_decoding_is_a_clear_invalid_argument(tmp_path) -> None:
    """Dummy weights with a small vocabulary get a word-level tokenizer, which llguidance cannot
    map to bytes: a constrained request on them ends with invalid_structured_output saying so,
    and the engine goes on serving unconstrained requests."""
    cfg = EngineConfig(ModelConfig(model="dummy:tiny-qwen3", max_model_len=128, cache_dir=str(tmp_path)),
                       CacheConfig(), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    engine = LLMEngine(cfg)
    try:
        engine.add_request("so", [5, 6, 7], SamplingParams(max_tokens=4, structured_output=SMALL_JSON))
        engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        ended = {}
        for _ in range(50):
            ended.update({o.request_id: o for o in engine.step() if o.finished})
            if len(ended) == 2:
                break
        assert ended["so"].finish_reason == FinishReason.ERROR
        assert "needs a tokenizer whose tokens map to bytes" in ended["so"].stop_reason.detail
        assert "tokenizer.json" in ended["so"].stop_reason.detail
        assert ended["plain"].finish_reason == FinishReason.LENGTH and ended["plain"].num_output_tokens == 4
    finally:
        engine.close()
