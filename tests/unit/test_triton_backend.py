"""The Triton path of the engine (attention backend, fused layers, CUDA-graph padding) on CPU.

Triton's interpreter runs the kernels on CPU, so the wiring is checked here: a ModelRunner with
`attention_backend="triton"` against one with `"torch"` on the same weights, step by step
(prefill, chunked prefill after a prefix-cache hit, mixed batches, decodes), plus the pure
bucket/padding logic of `cuda_graphs.py` and the padded fixed-buffer decode path run eagerly.
Shapes are tiny: the interpreter is slow.
"""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from tandem.cli import _engine_config, _engine_flags, build_parser  # noqa: E402
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from tandem.engine_service.worker.cuda_graphs import (  # noqa: E402
    BATCH_BUCKETS,
    DecodeCudaGraphs,
    bucket_for,
    capture_sizes,
    pad_decode_inputs,
    splits_per_bucket,
)
from tandem.engine_service.dummy_configs import get_dummy_config  # noqa: E402
from tandem.engine_service.worker.piecewise_graphs import PiecewiseCudaGraphs, token_buckets  # noqa: E402
from tandem.engine_service.worker.input_batch import (  # noqa: E402
    PinnedStaging,
    build_model_inputs,
    host_to_device,
    prepare_host_inputs,
)
from tandem.engine_service.layers.attention import TorchReferenceBackend  # noqa: E402
from tandem.engine_service.layers.backend_select import select_attention_backend  # noqa: E402
from tandem.engine_service.layers.triton_backend import TritonAttentionBackend  # noqa: E402
from tandem.engine_service.worker.model_runner import ModelRunner  # noqa: E402
from tandem.engine_service.sequence import SamplingParams, Sequence  # noqa: E402
from tandem.kernels.paged_attention import choose_num_splits  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 40
ATOL = 1e-4


@dataclass
class Scheduled:
    """Stand-in for the scheduler's ScheduledSeq (the runner duck-types it)."""

    seq: Sequence
    num_new_tokens: int
    sample: bool


def engine_config(model: str, backend: str, **model_kwargs) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=model, attention_backend=backend, dtype="float32", **model_kwargs),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        SchedulerConfig(),
    )


class Allocator:
    """Hands out blocks in a shuffled order, so a wrong block-table lookup cannot pass."""

    def __init__(self) -> None:
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()

    def cover(self, work: list[Scheduled]) -> list[Scheduled]:
        for w in work:
            while len(w.seq.block_table) * BLOCK_SIZE < w.seq.num_computed_tokens + w.num_new_tokens:
                w.seq.block_table.append(self.free.pop())
        return work


def advance(work: list[Scheduled], logits: torch.Tensor) -> None:
    """What the scheduler and engine do after a step: count computed tokens, append samples."""
    rows = iter(logits.argmax(-1).tolist())
    for w in work:
        w.seq.num_computed_tokens += w.num_new_tokens
        if w.sample:
            w.seq.append_token(next(rows))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def used_blocks(seqs: list[Sequence]) -> list[int]:
    return sorted({b for s in seqs for b in s.block_table})


# -------------------------------------------------------------------------- selection and config


def test_backend_selection() -> None:
    assert isinstance(select_attention_backend("cpu"), TorchReferenceBackend)
    assert isinstance(select_attention_backend("cpu", "torch"), TorchReferenceBackend)
    assert isinstance(select_attention_backend("cpu", "triton"), TritonAttentionBackend)
    # Selection needs no GPU: it only decides; CUDA picks Triton on auto.
    assert isinstance(select_attention_backend("cuda", "auto"), TritonAttentionBackend)
    assert isinstance(select_attention_backend("cuda", "torch"), TorchReferenceBackend)
    with pytest.raises(ValueError, match="attention backend"):
        select_attention_backend("cpu", "flash")
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="flash").validate()


def test_cli_flags_reach_the_config_and_the_engine_child() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--attention-backend", "triton", "--enforce-eager"])
    mc = _engine_config(args).model
    assert (mc.attention_backend, mc.enforce_eager) == ("triton", True)
    child = parser.parse_args(["engine", *_engine_flags(args)])
    assert (child.attention_backend, child.enforce_eager) == ("triton", True)
    defaults = _engine_config(parser.parse_args(["engine"])).model
    assert (defaults.attention_backend, defaults.enforce_eager) == ("auto", False)


# -------------------------------------------------------------------------- fused model weights


def test_fused_model_has_the_same_seeded_weights() -> None:
    """Merged q/k/v and gate/up weights are views: the seeded initialiser fills them exactly as
    it fills the separate projections of the PyTorch model (tiny-qwen2 also merges q/k/v bias)."""
    ref = ModelRunner(engine_config("dummy:tiny-qwen2", "torch")).model
    fused = ModelRunner(engine_config("dummy:tiny-qwen2", "triton")).model
    ref_state, fused_state = ref.state_dict(), fused.state_dict()
    assert ref_state.keys() == fused_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(tensor, fused_state[name]), name
    attn, mlp = fused.model.layers[1].self_attn, fused.model.layers[1].mlp
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(attn.qkv.weight, qkv) and attn.qkv.bias is not None
    assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()  # a view, not a copy
    assert torch.equal(mlp.gate_up.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def hf_checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A random HF checkpoint; its norm scales (Qwen3's per-head q/k norm too) are not 1."""
    family = request.param
    cfg = get_dummy_config(f"tiny-{family}")
    torch.manual_seed(5)
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    hf = model_cls(config_cls(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    return hf, path


def test_checkpoint_loads_into_merged_weights(hf_checkpoint, execute) -> None:
    """Loading by name writes through the views: the Triton runner matches Hugging Face (for
    Qwen3 with the q/k norm fused into the RoPE kernel, reading the loaded norm weights)."""
    hf, path = hf_checkpoint
    runner = ModelRunner(engine_config(str(path), "triton"))
    seq = Sequence("a", tokens(11, seed=1), SamplingParams())
    logits = execute(runner, Allocator().cover([Scheduled(seq, 11, True)]))
    with torch.no_grad():
        ref = hf(torch.tensor([seq.prompt_token_ids])).logits[0, -1].float()
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(logits[0], ref, atol=ATOL, rtol=0)


# -------------------------------------------------------------------------- Triton vs torch runner


def randomize_norm_weights(model: torch.nn.Module, seed: int) -> None:
    """Norm scales away from the dummy loader's 1.0 (same values for the same architecture)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))


def count_qk_norm_calls(model: torch.nn.Module) -> list[int]:
    """Counts forward calls of the q_norm / k_norm modules (Qwen3) from now on."""
    calls = [0]
    for name, module in model.named_modules():
        if name.endswith(("q_norm", "k_norm")):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("model", ["dummy:tiny-qwen3", "dummy:tiny-llama"])
def test_triton_runner_matches_torch_runner(model: str, execute) -> None:
    ref = ModelRunner(engine_config(model, "torch"))
    tri = ModelRunner(engine_config(model, "triton"))
    assert (ref.attention_backend, tri.attention_backend) == ("torch-reference", "triton")
    for runner in (ref, tri):
        randomize_norm_weights(runner.model, seed=7)
    ref_qk_norms, tri_qk_norms = count_qk_norm_calls(ref.model), count_qk_norm_calls(tri.model)
    alloc = Allocator()
    a = Sequence("a", tokens(13, seed=2), SamplingParams())
    b = Sequence("b", tokens(10, seed=3), SamplingParams())
    # c shares a's first two blocks (8 tokens): a prefix-cache hit, as the block manager sets it up.
    c = Sequence("c", a.prompt_token_ids[:8] + tokens(7, seed=4), SamplingParams())

    def step(work: list[Scheduled]) -> None:
        alloc.cover(work)
        expected, got = execute(ref, work), execute(tri, work)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        for layer_ref, layer_tri in zip(ref.kv_caches, tri.kv_caches):
            blocks = used_blocks([a, b, c])
            torch.testing.assert_close(layer_tri[:, blocks], layer_ref[:, blocks], atol=1e-5, rtol=0)
        advance(work, expected)

    # Prefill: a whole, b's first chunk (no sample).
    step([Scheduled(a, 13, True), Scheduled(b, 6, False)])
    # Mixed: a decodes while b finishes its prompt (prefill kernel with a one-token sequence).
    step([Scheduled(a, 1, True), Scheduled(b, 4, True)])
    # c starts on a's cached blocks, chunked mid-block; the others decode.
    c.block_table = list(a.block_table[:2])
    c.num_computed_tokens = 8
    step([Scheduled(a, 1, True), Scheduled(b, 1, True), Scheduled(c, 3, False)])
    step([Scheduled(c, 4, True), Scheduled(a, 1, True), Scheduled(b, 1, True)])
    # Pure decode steps: the decode kernel, in a different batch order.
    step([Scheduled(b, 1, True), Scheduled(c, 1, True), Scheduled(a, 1, True)])
    step([Scheduled(c, 1, True), Scheduled(a, 1, True)])
    # Qwen3's q/k norm: separate modules on the PyTorch path, inside the RoPE kernel on Triton's.
    assert (ref_qk_norms[0] > 0, tri_qk_norms[0]) == ("qwen3" in model, 0)


def test_decode_kernel_routing_and_fixed_splits(monkeypatch) -> None:
    """Pure-decode steps go to the decode kernel with the metadata's fixed split count (what a
    captured graph uses); any step with a longer chunk goes to the prefill kernel."""
    from tandem.engine_service.layers import triton_backend

    calls: list[tuple[str, int | None]] = []
    decode, prefill = triton_backend.paged_decode_attention, triton_backend.paged_prefill_attention

    def spy_decode(*args, **kwargs):
        calls.append(("decode", kwargs["num_splits"]))
        return decode(*args, **kwargs)

    def spy_prefill(*args, **kwargs):
        calls.append(("prefill", None))
        return prefill(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy_decode)
    monkeypatch.setattr(triton_backend, "paged_prefill_attention", spy_prefill)
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, d = 4, 2, 16
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, d, generator=gen)
    alloc = Allocator()
    seqs = [Sequence(f"s{i}", tokens(n, seed=i), SamplingParams()) for i, n in enumerate((30, 9))]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    work = alloc.cover([Scheduled(s, 1, True) for s in seqs])
    md = build_model_inputs(work, BLOCK_SIZE, torch.device("cpu")).metadata
    q = torch.randn(2, heads, d, generator=gen)
    k, v = torch.randn(2, kv_heads, d, generator=gen), torch.randn(2, kv_heads, d, generator=gen)
    expected = TorchReferenceBackend().forward(q, k, v, kv_cache.clone(), md, 0.25)
    for splits in (1, 3):
        md.decode_num_splits = splits
        got = TritonAttentionBackend().forward(q, k, v, kv_cache.clone(), md, 0.25)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert calls == [("decode", 1), ("decode", 3)]

    seqs[1].num_computed_tokens -= 1  # a two-token chunk: no longer a pure decode step
    mixed = build_model_inputs(alloc.cover([Scheduled(seqs[0], 1, True), Scheduled(seqs[1], 2, True)]),
                               BLOCK_SIZE, torch.device("cpu")).metadata
    q3, k3, v3 = (torch.randn(3, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    expected = TorchReferenceBackend().forward(q3, k3, v3, kv_cache.clone(), mixed, 0.25)
    got = TritonAttentionBackend().forward(q3, k3, v3, kv_cache.clone(), mixed, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert calls[-1] == ("prefill", None)


# -------------------------------------------------------------------------- CUDA-graph bucketing


def test_capture_sizes_are_capped_buckets() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000) == list(BATCH_BUCKETS)
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_for_picks_the_smallest_fit() -> None:
    sizes = capture_sizes(100)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    assert bucket_for(101, sizes) is None


def test_splits_are_fixed_per_bucket() -> None:
    sizes = capture_sizes(256)
    splits = splits_per_bucket(sizes, num_kv_heads=8, max_blocks_per_seq=256, block_size=16, num_units=132)
    assert splits == {b: choose_num_splits(b, 8, 256 * 16, 132) for b in sizes}
    # More sequences already fill the GPU: never more splits for a larger bucket.
    ordered = [splits[b] for b in sizes]
    assert ordered == sorted(ordered, reverse=True) and ordered[0] > 1 and ordered[-1] == 1


def decode_host_inputs():
    seqs = [Sequence(f"s{i}", tokens(n, seed=10 + i), SamplingParams()) for i, n in enumerate((6, 9, 1))]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    work = Allocator().cover([Scheduled(s, 1, True) for s in seqs])
    return prepare_host_inputs(work, BLOCK_SIZE), seqs


def test_pad_decode_inputs_adds_scratch_rows() -> None:
    host, seqs = decode_host_inputs()
    scratch = NUM_BLOCKS
    padded = pad_decode_inputs(host, 8, scratch, BLOCK_SIZE)
    assert padded.input_ids.shape == padded.positions.shape == padded.seq_lens.shape == (8,)
    np.testing.assert_array_equal(padded.input_ids[:3], [s.last_token_id for s in seqs])
    np.testing.assert_array_equal(padded.positions[:3], [5, 8, 0])
    np.testing.assert_array_equal(padded.seq_lens, [6, 9, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(padded.slot_mapping[:3], host.slot_mapping)
    assert (padded.slot_mapping[3:] == scratch * BLOCK_SIZE).all()
    assert padded.block_tables.shape == (8, host.block_tables.shape[1])
    np.testing.assert_array_equal(padded.block_tables[:3], host.block_tables)
    assert (padded.block_tables[3:] == scratch).all() and (padded.input_ids[3:] == 0).all()
    assert pad_decode_inputs(host, 3, scratch, BLOCK_SIZE).seq_lens.tolist() == [6, 9, 1]
    with pytest.raises(ValueError, match="fit"):
        pad_decode_inputs(host, 2, scratch, BLOCK_SIZE)
    prefill = prepare_host_inputs(Allocator().cover([Scheduled(Sequence("p", [1, 2, 3], SamplingParams()), 3, True)]),
                                  BLOCK_SIZE)
    with pytest.raises(ValueError, match="pure-decode"):
        pad_decode_inputs(prefill, 4, scratch, BLOCK_SIZE)


def test_pinned_staging_packs_like_plain_copies() -> None:
    host, _ = decode_host_inputs()
    staging = PinnedStaging(torch.device("cpu"))
    plain = host_to_device(host, torch.device("cpu"))
    first = host_to_device(host, torch.device("cpu"), staging)
    bigger, _ = decode_host_inputs()
    bigger.block_tables = np.tile(bigger.block_tables, (1, 600))  # forces the buffers to grow
    host_to_device(bigger, torch.device("cpu"), staging)
    for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices"):
        got, want = getattr(first.metadata, name), getattr(plain.metadata, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name  # survived the refill
        # Every view starts 16-byte aligned, whatever the batch size (one Triton variant).
        assert got.data_ptr() % 16 == 0, name
    assert torch.equal(first.input_ids, plain.input_ids)


def test_padded_decode_buffers_match_eager_execution(execute) -> None:
    """The graph runner's fixed, padded buffers (run eagerly here) give the same logits and the
    same KV cache as plain execution; dummy rows only ever write the scratch block."""
    model = "dummy:tiny-qwen3"
    eager = ModelRunner(engine_config(model, "triton"))
    padded = ModelRunner(engine_config(model, "triton"))
    graphs = DecodeCudaGraphs(
        padded.model, padded.kv_caches, sizes=[1, 2, 4], block_size=BLOCK_SIZE,
        max_blocks_per_seq=padded.max_model_len // BLOCK_SIZE, scratch_block=padded.scratch_block,
        num_kv_heads=2, device=torch.device("cpu"), capture_graphs=False,
    )
    graphs.capture()
    assert graphs.num_splits[1] > 1  # the one-sequence bucket runs split-KV, as on a GPU
    staging = PinnedStaging(torch.device("cpu"))
    alloc = Allocator()
    seqs = [Sequence(f"s{i}", tokens(n, seed=20 + i), SamplingParams()) for i, n in enumerate((7, 5, 10))]
    prefill = alloc.cover([Scheduled(s, s.num_tokens, True) for s in seqs])
    logits = execute(eager, prefill)
    execute(padded, prefill)
    advance(prefill, logits)
    fresh = Sequence("p", [1, 2, 3], SamplingParams())
    assert not graphs.can_run(prepare_host_inputs(Allocator().cover([Scheduled(fresh, 3, True)]), BLOCK_SIZE))

    # Buckets 4 (one dummy row), 1, 2, then 4 with a row that does not sample (a one-token
    # prefill chunk looks like a decode): only sampling rows come back.
    batches = [[(s, True) for s in seqs], [(seqs[0], True)], [(s, True) for s in seqs[1:]],
               [(seqs[2], True), (seqs[0], False), (seqs[1], True)]]
    for batch in batches:
        work = alloc.cover([Scheduled(s, 1, sample) for s, sample in batch])
        host = prepare_host_inputs(work, BLOCK_SIZE)
        assert graphs.can_run(host)
        expected, got = execute(eager, work), graphs.run(host, staging)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        advance(work, expected)
    blocks = used_blocks(seqs)
    assert padded.scratch_block not in blocks
    for layer_eager, layer_padded in zip(eager.kv_caches, padded.kv_caches):
        torch.testing.assert_close(layer_padded[:, blocks], layer_eager[:, blocks], atol=1e-5, rtol=0)
        untouched = [i for i in range(NUM_BLOCKS) if i not in blocks]
        assert (layer_padded[:, untouched] == 0).all()
        assert layer_padded[:, padded.scratch_block].abs().sum() > 0  # the dummy rows wrote here
    too_big = prepare_host_inputs(alloc.cover([Scheduled(seqs[1], 1, True)] * 5), BLOCK_SIZE)
    assert not graphs.can_run(too_big)


# -------------------------------------------------------------------------- piecewise graphs

def test_token_buckets_grow_by_doubling_then_linearly() -> None:
    assert token_buckets(8) == [8]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 512, 768, 1024]
    assert token_buckets(1000)[-2:] == [768, 1000]
    with pytest.raises(ValueError):
        token_buckets(0)


# One model keeps the interpreter's bill small: the MoE one covers the dense layers' code too, and
# a sequence bucket of 2 sends its one- and two-sequence steps whole and its three-sequence steps
# through the pieces.
@pytest.mark.parametrize(("model", "whole_batches"), [("dummy:tiny-qwen3-moe", (2,))])
def test_piecewise_buffers_match_eager_execution(model: str, whole_batches: tuple[int, ...], execute) -> None:
    """Steps with prefill rows through the piecewise runner's fixed, padded buffers (run eagerly
    here: the attention calls between pieces as a replay makes them, or the whole forward on the
    fixed length buffers for steps of few sequences) give eager execution's logits and KV cache;
    dummy rows write only the scratch block, also after a longer step in the same bucket left
    real slots in the buffers' tail, and padded sequences change nothing."""
    eager = ModelRunner(engine_config(model, "triton"))
    padded = ModelRunner(engine_config(model, "triton"))
    graphs = PiecewiseCudaGraphs(padded.model, padded.layer_caches, max_tokens=24, block_size=BLOCK_SIZE,
                                 max_blocks_per_seq=padded.max_model_len // BLOCK_SIZE,
                                 scratch_block=padded.scratch_block, device=torch.device("cpu"),
                                 capture_graphs=False, whole_batches=whole_batches)
    graphs.capture()
    assert graphs.captured_sizes == [16, 24]
    whole_runs = []
    run_whole = graphs._run_whole
    graphs._run_whole = lambda *args: whole_runs.append(args[2].num_seqs) or run_whole(*args)
    assert len(graphs._buckets[16].calls) == eager.model.config.num_hidden_layers
    staging = PinnedStaging(torch.device("cpu"))
    alloc = Allocator()
    a = Sequence("a", tokens(14, seed=5), SamplingParams())
    b = Sequence("b", tokens(9, seed=6), SamplingParams())
    c = Sequence("c", tokens(11, seed=7), SamplingParams())
    steps = [
        [Scheduled(a, 14, True)],                                          # 14 of bucket 16
        [Scheduled(a, 1, True), Scheduled(b, 9, True)],                    # mixed, 10 of 16
        [Scheduled(b, 1, True), Scheduled(c, 6, False), Scheduled(a, 1, True)],  # 8 of 16, tail reset
        [Scheduled(c, 5, True), Scheduled(a, 1, True), Scheduled(b, 1, True)],
        [Scheduled(c, 1, True), Scheduled(a, 1, True)],                    # pure decode: not ours
    ]
    ran = 0
    for work in steps:
        alloc.cover(work)
        host = prepare_host_inputs(work, BLOCK_SIZE)
        expected = execute(eager, work)
        if graphs.can_run(host):
            got = graphs.run(host, staging)
            ran += 1
        else:
            assert host.is_pure_decode
            got = execute(padded, work)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        advance(work, expected)
    assert ran == 4
    # The steps bring 1, 2, 3 and 3 sequences: whole graphs take those within the largest bucket.
    assert whole_runs == [n for n in (1, 2, 3, 3) if whole_batches and n <= max(whole_batches)]
    blocks = used_blocks([a, b, c])
    for layer_eager, layer_padded in zip(eager.kv_caches, padded.kv_caches):
        torch.testing.assert_close(layer_padded[:, blocks], layer_eager[:, blocks], atol=1e-5, rtol=0)
        untouched = [i for i in range(NUM_BLOCKS) if i not in blocks]
        assert (layer_padded[:, untouched] == 0).all()
        assert layer_padded[:, padded.scratch_block].abs().sum() > 0  # the dummy rows wrote here
    too_big = prepare_host_inputs(alloc.cover([Scheduled(Sequence("d", tokens(30, seed=8), SamplingParams()), 30, True)]),
                                  BLOCK_SIZE)
    assert not graphs.can_run(too_big)
