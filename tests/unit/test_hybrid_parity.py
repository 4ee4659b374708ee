"""Hybrid models (Gated DeltaNet + gated attention) against transformers' own classes, on CPU.

Tiny random-weight checkpoints of Qwen3.5 dense (and, with the MoE block, Qwen3-Next and
Qwen3.5-MoE) are saved by transformers and loaded by our loader. Two levels:

- the model over its caches, driven step by step (`HybridHarness`): every step's logits match
  transformers' full-sequence forward and give the same greedy token, for 32 decode steps after
  a prompt prefilled in >= 3 chunks, and for several requests batched together (prefill and
  decode rows mixed, state slots not in request order);
- the whole engine (scheduler, block manager, state slots, worker rows, runner): 32 greedy
  tokens identical to transformers for one request, a batch under a 5-token budget (chunked
  prefill, with and without overlapped scheduling), and a cache so small that requests are
  preempted and rebuild their state by recompute. Every block and state slot is free at the end.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.worker.loader import build_model, resolve_model
from tandem.engine_service.sequence import SamplingParams, Sequence
from tests.hf_reference import hf_reference
from tests.conftest import drive_greedy, model_rows

STEPS = 32
BLOCK_SIZE = 4
NUM_BLOCKS = 96
NUM_SLOTS = 6
ATOL = 2e-4
FAMILIES = ["tiny-qwen3.5", "tiny-qwen3-next", "tiny-qwen3.5-moe"]


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(n, seed=40 + i) for i, n in enumerate((21, 9, 30, 14))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread is faster than several fighting over a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory, hf_checkpoint) -> tuple[str, torch.nn.Module, Path]:
    hf, path = hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, hf, path


class HybridHarness:
    """Our model over paged K/V and state pools, with hand-made block tables and state slots."""

    def __init__(self, path: Path) -> None:
        self.model = build_model(resolve_model(str(path)), "cpu", torch.float32)
        layout = self.model.cache_layout("float32")
        cfg = self.model.config
        self.caches: list = [None] * cfg.num_hidden_layers
        for group in layout.groups:
            for layer in group.layer_ids:
                if group.paged:
                    spec = group.spec
                    self.caches[layer] = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
                else:
                    # Garbage in every slot: a fresh request must not read what a slot held before.
                    self.caches[layer] = tuple(torch.randn(NUM_SLOTS + 1, *shape) for shape in group.spec.shapes)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
        self.free_slots = [4, 1, 5, 0, 3, 2]  # not in admission order

    def new_seq(self, tokens: list[int], rid: str = "r") -> Sequence:
        seq = Sequence(rid, tokens, SamplingParams())
        seq.state_slot = self.free_slots.pop(0)
        return seq

    @torch.inference_mode()
    def step(self, work: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """Run `n` new tokens of each sequence; each one's logits for all its new rows."""
        for seq, n in work:
            while len(seq.block_table) * BLOCK_SIZE < seq.num_computed_tokens + n:
                seq.block_table.append(self.free_blocks.pop())
        return model_rows(self.model, self.caches, work, BLOCK_SIZE)


def check_steps(ours: torch.Tensor, ref: torch.Tensor, tokens: list[int], num_prompt: int) -> None:
    """Per-position logits within tolerance; every decode step's greedy token identical."""
    assert ref.abs().max() > 0.5  # logits are not degenerate, so the tolerance means something
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ours[num_prompt - 1 : -1].argmax(-1).tolist() == tokens[num_prompt:]


def test_chunked_prefill_then_decode_matches_transformers(checkpoint) -> None:
    _, hf, path = checkpoint
    tokens = PROMPTS[0]
    reference = hf_reference(hf, tokens, STEPS)
    continuation, ref = reference.continuation, reference.logits
    full = tokens + continuation
    harness = HybridHarness(path)
    seq = harness.new_seq(full)
    rows = [harness.step([(seq, n)])[0] for n in (5, 9, 7)]  # >= 3 chunks, edges mid-block
    rows += [harness.step([(seq, 1)])[0] for _ in range(len(continuation))]
    check_steps(torch.cat(rows), ref, full, len(tokens))


def test_concurrent_batch_matches_transformers(checkpoint) -> None:
    _, hf, path = checkpoint
    harness = HybridHarness(path)
    refs = [hf_reference(hf, p, STEPS) for p in PROMPTS[:3]]
    fulls = [p + r.continuation for p, r in zip(PROMPTS[:3], refs)]
    a, b, c = (harness.new_seq(f, rid) for f, rid in zip(fulls, "abc"))
    rows: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    # a and b prefill together; then a decodes while b finishes its prompt and c starts (decode
    # and prefill rows in one step); then all three decode together.
    for name, out in zip("ab", harness.step([(a, 16), (b, 4)])):
        rows[name].append(out)
    for name, out in zip("abc", harness.step([(a, 5), (b, 5), (c, 30)])):
        rows[name].append(out)
    for _ in range(STEPS):
        for name, out in zip("abc", harness.step([(a, 1), (b, 1), (c, 1)])):
            rows[name].append(out)
    for name, p, full, ref in zip("abc", PROMPTS[:3], fulls, refs):
        check_steps(torch.cat(rows[name]), ref.logits, full, len(p))


def test_fresh_request_ignores_its_slots_previous_state(checkpoint) -> None:
    """A request admitted into a slot another request just left starts from zero state."""
    _, hf, path = checkpoint
    harness = HybridHarness(path)
    first = harness.new_seq(PROMPTS[1], "first")
    harness.step([(first, len(PROMPTS[1]))])
    second = Sequence("second", PROMPTS[3], SamplingParams())
    second.state_slot = first.state_slot  # the slot is reused without being cleared
    (ours,) = harness.step([(second, len(PROMPTS[3]))])
    ref = hf_reference(hf, PROMPTS[3], STEPS).logits
    torch.testing.assert_close(ours, ref[: len(PROMPTS[3])], atol=ATOL, rtol=0)


# -- the whole engine --------------------------------------------------------------------------


def make_engine(path: Path, num_blocks: int = 128, budget: int = 256, max_num_seqs: int = 4,
                overlap: str = "off", backend: str = "torch") -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(model=str(path), attention_backend=backend, max_model_len=256),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, overlap_scheduling=overlap),
    ))


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    out = drive_greedy(engine, prompts, STEPS)
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and all(p.num_free == p.num_blocks for p in bm.pools), "blocks leaked"
    assert bm.state_slots is not None and bm.state_slots.num_used == 0, "state slots leaked"
    return out


def test_engine_single_request_matches_transformers(checkpoint) -> None:
    _, hf, path = checkpoint
    engine = make_engine(path)
    # Prefix caching stays on: hits need a state checkpoint (tests/unit/test_hybrid_prefix_cache.py).
    assert engine.block_manager.enable_prefix_caching and engine.block_manager.checkpoints is not None
    (ours,) = run(engine, [PROMPTS[0]])
    assert ours == hf_reference(hf, PROMPTS[0], STEPS).continuation


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_engine_batched_chunked_prefill_matches_transformers(checkpoint, overlap: str) -> None:
    _, hf, path = checkpoint
    prompts = PROMPTS[:3]
    ours = run(make_engine(path, budget=5, overlap=overlap), prompts)  # every prompt in >= 2 chunks
    assert ours == [hf_reference(hf, p, STEPS).continuation for p in prompts]


def test_engine_preempted_requests_rebuild_state(checkpoint) -> None:
    _, hf, path = checkpoint
    prompts = PROMPTS
    # 24 blocks of 4 tokens cannot hold four requests of 9-30 prompt + 32 output tokens.
    engine = make_engine(path, num_blocks=24, budget=8)
    ours = run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert ours == [hf_reference(hf, p, STEPS).continuation for p in prompts]


def test_engine_abort_returns_the_slot_and_its_next_owner_starts_clean(checkpoint) -> None:
    """A request aborted mid-decode gives its state slot back (its state still in the pool); the
    request admitted into that slot next computes as if the slot were new."""
    _, hf, path = checkpoint
    engine = make_engine(path, max_num_seqs=1)  # one slot: the second request must reuse it
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    engine.add_request("doomed", PROMPTS[2], params)
    for _ in range(5):
        engine.step()
    slots = engine.block_manager.state_slots
    assert slots is not None and slots.num_used == 1
    engine.abort("doomed")
    assert slots.num_used == 0 and engine.block_manager.num_used_blocks == 0
    (ours,) = run(engine, [PROMPTS[3]])
    assert ours == hf_reference(hf, PROMPTS[3], STEPS).continuation


# -- released-checkpoint layout and the CUDA-graph buffers ---------------------------------------


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_vision_language_checkpoint_serves_its_text_model(tmp_path: Path, name: str) -> None:
    """A Qwen3.5 checkpoint as released: the text model inside a vision-language one (config
    `text_config`, weights `model.language_model.*`, a vision tower `model.visual.*`). Our model
    loads the text part and matches transformers' whole model on a text prompt."""
    import transformers

    from tandem.engine_service.dummy_configs import get_dummy_config

    text = get_dummy_config(name)
    text.pop("architectures")
    wrappers = {"qwen3_5_text": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
                "qwen3_5_moe_text": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration)}
    config_cls, model_cls = wrappers[text["model_type"]]
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": text["hidden_size"], "num_position_embeddings": 64}
    torch.manual_seed(7)
    hf = model_cls(config_cls(text_config=text, vision_config=vision)).float().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "language_model" in pname and "norm" in pname and not pname.endswith("linear_attn.norm.weight"):
                p.normal_(0.0, 0.2)
            elif "embed_tokens" in pname:
                p.normal_(0.0, 1.0)
            elif not pname.endswith(("A_log", "linear_attn.norm.weight")):
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path / "vl")
    harness = HybridHarness(tmp_path / "vl")
    assert type(harness.model).__name__ == ("Qwen3_5ForCausalLM" if name == "tiny-qwen3.5" else "Qwen3_5MoeForCausalLM")
    tokens = PROMPTS[2]
    seq = harness.new_seq(tokens)
    ours = torch.cat([harness.step([(seq, n)])[0] for n in (17, 13)])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), use_cache=False).logits[0].float()
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_decode_through_graph_buffers_with_state_slots(checkpoint) -> None:
    """Decode through the CUDA-graph runner's fixed, padded buffers (run eagerly on CPU): real
    rows read their state slots from the fixed index buffer, padded rows the scratch slot, and
    the tokens match transformers. A pure-decode step whose request starts its state (a
    one-token prompt admitted while others decode) is refused by the graphs and runs eagerly."""
    from tandem.engine_service.worker.cuda_graphs import DecodeCudaGraphs

    _, hf, path = checkpoint
    engine = make_engine(path, budget=64, max_num_seqs=4)
    runner = engine.runner
    scratch = runner.memory_plan.num_state_slots
    graphs = DecodeCudaGraphs(
        runner.model, runner.layer_caches, sizes=[1, 2, 4], block_size=BLOCK_SIZE,
        max_blocks_per_seq=runner.max_model_len // BLOCK_SIZE, scratch_block=runner.scratch_block,
        num_kv_heads=runner.arch_config.num_key_value_heads, device=torch.device("cpu"), capture_graphs=False,
        scratch_state_slot=scratch,
    )
    graphs.capture()
    slots_seen: list[list[int]] = []
    refused_fresh: list[bool] = []
    forward, can_run = graphs._forward, graphs.can_run

    def forward_with_host_lengths(bucket, metadata):
        # The reference attention loops over host lengths, which graph metadata does not carry
        # (the GPU kernels read the device buffer): hand it the buffer's lengths.
        slots_seen.append(graphs.state_indices[:bucket].tolist())
        lengths = graphs.seq_lens[:bucket].tolist()
        return forward(bucket, dataclasses.replace(metadata, seq_lens_cpu=lengths, _group_views={}))

    def recording_can_run(host):
        ok = can_run(host)
        if host.is_pure_decode and not ok:
            refused_fresh.append(not host.has_initial_state.all())
        return ok

    graphs._forward, graphs.can_run = forward_with_host_lengths, recording_can_run
    runner.cuda_graphs = graphs
    for layers in runner.cache_tensors.state.values():  # garbage a fresh request must never read
        for pools in layers.values():
            for pool in pools:
                pool.normal_()
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0][:1]]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {"r0": [], "r1": [], "r2": []}
    engine.add_request("r0", prompts[0], params)
    engine.add_request("r1", prompts[1], params)
    for step in range(5000):
        if step == 3:  # r0 and r1 decode; r2's single prompt token joins a pure-decode step
            engine.add_request("r2", prompts[2], params)
        if step > 3 and not engine.has_work():
            break
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    assert [out[r] for r in ("r0", "r1", "r2")] == [hf_reference(hf, p, STEPS).continuation for p in prompts]
    assert any(len(row) == 4 for row in slots_seen), "three requests decoded in a padded bucket of 4"
    for row in slots_seen:  # real rows first, each on its own slot; padding on the scratch slot
        real = [s for s in row if s != scratch]
        assert row == real + [scratch] * (len(row) - len(real)) and len(set(real)) == len(real)
        assert all(0 <= s < scratch for s in real)
    assert all(row[-1] == scratch for row in slots_seen if len(row) == 4)
    assert True in refused_fresh, "the step starting r2's state ran outside the graphs"
    assert engine.block_manager.state_slots.num_used == 0


def test_triton_op_set_matches_transformers(tmp_path: Path, hf_checkpoint) -> None:
    """The op set the GPU runs — Triton attention, the Triton GDN kernels (conv1d, chunked and
    recurrent gated delta rule, gated norm), the fused MoE and MLP — interpreted on CPU, for the
    most involved family (packed projections, dense and MoE layers): prefill in 3 chunks, then
    decode, the same greedy tokens as transformers. Short: the interpreter is slow."""
    hf, path = hf_checkpoint(tmp_path, "tiny-qwen3-next")
    engine = make_engine(path, budget=4, backend="triton")
    assert engine.runner.attention_backend == "triton"
    assert all(layer.linear_attn.fused for layer in engine.runner.model.model.layers if layer.is_linear)
    steps = 3
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    engine.add_request("r0", PROMPTS[1], params)
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert out == hf_reference(hf, PROMPTS[1], STEPS).continuation[:steps]
