"""Qwen3-MoE through the whole engine against transformers' own Qwen3MoeForCausalLM.

A tiny random-weight checkpoint (`tiny-qwen3-moe`: 8 experts, 2 per token, layers 0 and 2
sparse, layer 1 dense through `mlp_only_layers`) saved by transformers' `save_pretrained` (one
tensor per expert on disk), loaded by our loader, run on CPU through the scheduler, block
manager and runner. For 32 greedy steps every token must equal transformers' and every step's
reported logprobs (the sampled token's and the top 5, i.e. the logits up to their softmax
normaliser) must match transformers' full-sequence forward: a single request, a concurrent
batch, prefill in >= 3 chunks, after a preemption, and a prefix-cache hit; plus the Triton op
set (interpreted on CPU), the stacked-expert checkpoint layout and the sparse-layer choice.
"""

from __future__ import annotations

import os

# The Triton test below interprets the kernels on CPU; Triton reads this when first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from tandem.engine_service.dummy_configs import get_dummy_config  # noqa: E402
from tandem.engine_service.core.engine import LLMEngine  # noqa: E402
from tandem.engine_service.layers.moe import SparseMoeBlock  # noqa: E402
from tandem.engine_service.worker.loader import WeightLoadError, build_model, resolve_model  # noqa: E402
from tandem.engine_service.sequence import SamplingParams  # noqa: E402
from tests.hf_reference import assert_logprobs_match, compute_reference, hf_reference  # noqa: E402

STEPS = 32
BLOCK_SIZE = 4
TOP_LOGPROBS = 5
LOGPROB_ATOL = 1e-4
DUMMY = "tiny-qwen3-moe"


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(n, seed=50 + i) for i, n in enumerate((21, 11, 30, 17))]


def make_hf_moe(directory: Path, **overrides) -> tuple[torch.nn.Module, Path]:
    """transformers' Qwen3MoeForCausalLM of the tiny config, every parameter randomised (norm
    scales too, so a weight that fails to load changes the logits), saved with save_pretrained."""
    import transformers

    cfg = get_dummy_config(DUMMY) | overrides
    torch.manual_seed(4321)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # a decisive router: top-k choices far from ties
            else:
                p.normal_(0.0, 0.1)
    path = directory / DUMMY
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    return make_hf_moe(tmp_path_factory.mktemp("moe"))


def make_engine(path: Path, num_blocks: int = 128, budget: int = 256, max_num_seqs: int = 8,
                backend: str = "torch") -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(model=str(path), attention_backend=backend, max_model_len=256),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
    ))


class Run:
    """Outputs of one engine run: tokens and logprob reports per request, steps taken."""

    def __init__(self, engine: LLMEngine, prompts: list[list[int]], steps: int = STEPS, on_step=None) -> None:
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.logprobs: list[list] = [[] for _ in prompts]
        self.first_token_step: list[int | None] = [None] * len(prompts)
        self.num_steps = 0
        for _ in range(5000):
            if not engine.has_work():
                break
            self.num_steps += 1
            for o in engine.step():
                i = int(o.request_id[1:])
                if o.new_token_ids and self.first_token_step[i] is None:
                    self.first_token_step[i] = self.num_steps
                self.tokens[i].extend(o.new_token_ids)
                self.logprobs[i].extend(o.new_logprobs)
            if on_step is not None:
                on_step(engine)
        assert engine.block_manager.num_used_blocks == 0, "blocks leaked"


def assert_matches_hf(hf: torch.nn.Module, prompt_tokens: list[int], tokens: list[int], logprobs: list,
                      steps: int = STEPS) -> None:
    assert_logprobs_match(hf_reference(hf, prompt_tokens, STEPS), tokens, logprobs, steps, LOGPROB_ATOL)


def test_tiny_config_routes_through_several_experts(checkpoint) -> None:
    """Guards the parity tests: the model is sparse where transformers says, the router spreads
    the prompt over most experts, and routing matters (renormalising changes the logits)."""
    hf, path = checkpoint
    model = build_model(resolve_model(str(path)), "cpu", torch.float32)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"]
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == [
        "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    seen: set[int] = set()
    hook = hf.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: seen.update(o[2].flatten().tolist()))
    compute_reference(hf, PROMPTS[0], STEPS)
    hook.remove()
    assert len(seen) >= 6
    ref = hf(torch.tensor([PROMPTS[0]])).logits
    hf.config.norm_topk_prob = False
    for layer in (hf.model.layers[0], hf.model.layers[2]):
        layer.mlp.gate.norm_topk_prob = False
    try:
        assert (hf(torch.tensor([PROMPTS[0]])).logits - ref).abs().max() > 1e-2
    finally:
        for layer in (hf.model.layers[0], hf.model.layers[2]):
            layer.mlp.gate.norm_topk_prob = True
        hf.config.norm_topk_prob = True


def test_single_request_matches_transformers(checkpoint) -> None:
    hf, path = checkpoint
    run = Run(make_engine(path), [PROMPTS[0]])
    assert_matches_hf(hf, PROMPTS[0], run.tokens[0], run.logprobs[0])


def test_concurrent_batch_matches_transformers(checkpoint) -> None:
    hf, path = checkpoint
    run = Run(make_engine(path), PROMPTS)
    for p, tokens, logprobs in zip(PROMPTS, run.tokens, run.logprobs):
        assert_matches_hf(hf, p, tokens, logprobs)


def test_chunked_prefill_matches_transformers(checkpoint) -> None:
    hf, path = checkpoint
    budget = 6
    prompts = [PROMPTS[2], PROMPTS[1]]  # 30 and 11 tokens: 5 chunks, and a prefill sharing steps
    run = Run(make_engine(path, budget=budget), prompts)
    assert run.first_token_step[0] is not None and run.first_token_step[0] >= 3
    assert len(prompts[0]) >= 3 * budget
    for p, tokens, logprobs in zip(prompts, run.tokens, run.logprobs):
        assert_matches_hf(hf, p, tokens, logprobs)


def test_preempted_requests_match_transformers(checkpoint) -> None:
    hf, path = checkpoint
    engine = make_engine(path, num_blocks=24, budget=8)
    run = Run(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0
    for p, tokens, logprobs in zip(PROMPTS, run.tokens, run.logprobs):
        assert_matches_hf(hf, p, tokens, logprobs)


def test_prefix_cache_hit_matches_transformers(checkpoint) -> None:
    hf, path = checkpoint
    engine = make_engine(path, budget=8)
    shared = PROMPTS[2]
    first = Run(engine, [shared])
    hits_before = engine.block_manager.prefix_hits
    second_prompt = shared + first.tokens[0][:10] + prompt(3, seed=91)
    second = Run(engine, [second_prompt])
    assert engine.block_manager.prefix_hits - hits_before >= 32
    assert_matches_hf(hf, shared, first.tokens[0], first.logprobs[0])
    assert_matches_hf(hf, second_prompt, second.tokens[0], second.logprobs[0])


def test_triton_op_set_matches_transformers(checkpoint) -> None:
    """The fused op set (fused_moe and the merged router GEMM, interpreted on CPU) through the
    engine: mixed prefill/decode batches, then decode through the CUDA-graph runner's fixed,
    padded buffers (run eagerly here: padding rows are routed through the experts too and must
    not disturb the real rows)."""
    from tandem.engine_service.worker.cuda_graphs import DecodeCudaGraphs

    hf, path = checkpoint
    steps = 6  # the interpreter is slow
    prompts = [PROMPTS[3], PROMPTS[1], PROMPTS[0]]
    engine = make_engine(path, budget=8, backend="triton")
    runner = engine.runner
    assert runner.attention_backend == "triton"
    assert all(m.fused for m in runner.model.modules() if isinstance(m, SparseMoeBlock))
    graphs = DecodeCudaGraphs(
        runner.model, runner.kv_caches, sizes=[1, 2, 4], block_size=BLOCK_SIZE,
        max_blocks_per_seq=runner.max_model_len // BLOCK_SIZE, scratch_block=runner.scratch_block,
        num_kv_heads=2, device=torch.device("cpu"), capture_graphs=False,
    )
    graphs.capture()
    runner.cuda_graphs = graphs
    graph_calls: list[int] = []
    original = graphs.run
    graphs.run = lambda host, *a: graph_calls.append(host.num_seqs) or original(host, *a)
    run = Run(engine, prompts, steps=steps)
    for p, tokens, logprobs in zip(prompts, run.tokens, run.logprobs):
        assert_matches_hf(hf, p, tokens, logprobs, steps=steps)
    assert 3 in graph_calls, "a 3-row decode ran padded to the 4-row buffers"


def test_stacked_expert_checkpoint_loads(checkpoint, tmp_path: Path) -> None:
    """A checkpoint holding experts stacked (transformers' in-memory names, as Qwen3.5-MoE ships
    them) loads into the same model; a missing expert is reported."""
    import shutil

    from safetensors.torch import save_file

    hf, path = checkpoint
    stacked = tmp_path / "stacked"
    shutil.copytree(path, stacked)
    for f in stacked.glob("*.safetensors"):
        f.unlink()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    a = build_model(resolve_model(str(path)), "cpu", torch.float32)
    b = build_model(resolve_model(str(stacked)), "cpu", torch.float32)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name

    from safetensors import safe_open

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (file,) = broken.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj"):
        build_model(resolve_model(str(broken)), "cpu", torch.float32)


def test_sparse_step_and_unnormalised_routing_match_transformers(tmp_path: Path) -> None:
    """`decoder_sparse_step: 2` (only layer 1 sparse) and `norm_topk_prob: false`."""
    hf, path = make_hf_moe(tmp_path, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)
    model = build_model(resolve_model(str(path)), "cpu", torch.float32)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LlamaMLP", "SparseMoeBlock", "LlamaMLP"]
    steps = 8
    run = Run(make_engine(path, budget=8), [PROMPTS[1]], steps=steps)
    assert_matches_hf(hf, PROMPTS[1], run.tokens[0], run.logprobs[0], steps=steps)
