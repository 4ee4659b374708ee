"""FP8 checkpoints in the published block-wise layout, through the real loader and engine, against
transformers' own model classes run on the dequantized weights.

Each tiny model (Qwen3, Qwen3-MoE, Qwen3-Next) is saved by transformers, then rewritten as
DeepSeek and Qwen publish FP8: every projection (`*proj.weight`, the experts one tensor each) as
`float8_e4m3fn` with a float32 `*.weight_scale_inv` per 128x128 block (the tiny sizes leave
every block partial: ceil division, as the format allows), the embeddings, norms and routers
as they were, and `quantization_config` (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size`)
in config.json. transformers loads the same tensors dequantized (fp8 · scale) from a second
directory. For 32 greedy steps our tokens must equal transformers' and every step's logprobs
must match its full-sequence forward. Also: the FP8 layers really stay FP8 in memory,
per-channel scales load, `--quantization none` dequantizes, `--quantization fp8` quantizes a
float checkpoint on load, the fused (Triton, interpreted) op set agrees with the torch one,
and the embedded SmolLM2 under `--quantization fp8` still answers with Paris.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused op-set test interprets the kernels

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from tandem.engine_service.core.engine import LLMEngine  # noqa: E402
from tandem.engine_service.dummy_configs import get_dummy_config  # noqa: E402
from tandem.engine_service.layers.fp8 import PER_CHANNEL  # noqa: E402
from tandem.engine_service.sequence import SamplingParams  # noqa: E402
from tandem.engine_service.worker.loader import build_model, resolve_model  # noqa: E402
from tandem.kernels.fp8_gemm import FP8_DTYPE, dequantize, quantize  # noqa: E402
from tests.hf_reference import assert_logprobs_match, hf_reference  # noqa: E402

STEPS = 32
TOP_LOGPROBS = 5
LOGPROB_ATOL = 2e-4
BLOCK = (128, 128)
FAMILIES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-next"]


def is_projection(name: str, tensor: torch.Tensor) -> bool:
    """What the published checkpoints store in FP8: the projections, not embeddings, norms,
    routers (`mlp.gate`, `shared_expert_gate`) or the small `in_proj_ba`."""
    return tensor.dim() == 2 and name.endswith("proj.weight")


def write_fp8(source: Path, target: Path, block: tuple[int, int] | None, dequantized: Path | None = None) -> None:
    """Rewrite `source` as an FP8 checkpoint in `target` (`block` None: per-channel scales,
    `[N, 1]`); with `dequantized`, also the same weights dequantized, for transformers."""
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors |= load_file(str(file))
    fp8, plain = {}, {}
    for name, tensor in tensors.items():
        if is_projection(name, tensor):
            q, s = quantize(tensor, block or PER_CHANNEL)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            plain[name] = dequantize(q, s, block or PER_CHANNEL)
        else:
            fp8[name] = plain[name] = tensor
    config = json.loads((source / "config.json").read_text())
    for out, state, quantized in ((target, fp8, True), (dequantized, plain, False)):
        if out is None:
            continue
        shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        if quantized:
            qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": list(block) if block else None}
            (out / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))


# Tiny matrices: one torch thread per test (tests/conftest.py's fixture, not a copy of it).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory, hf_checkpoint) -> tuple[str, torch.nn.Module, Path]:
    """`(family, transformers on the dequantized weights, FP8 checkpoint directory)`."""
    import transformers

    root = tmp_path_factory.mktemp(request.param)
    _, source = hf_checkpoint(root, request.param, seed=2468, router_std=0.5)
    write_fp8(source, root / "fp8", BLOCK, root / "dequantized")
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "dequantized", dtype=torch.float32).eval()
    return request.param, hf, root / "fp8"


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(n, seed=70 + i) for i, n in enumerate((19, 12, 27))]
def run_engine(path: Path, prompts: list[list[int]], steps: int = STEPS, **model_kwargs) -> tuple[list, list]:
    engine = LLMEngine(EngineConfig(
        ModelConfig(model=str(path), max_model_len=256, **({"attention_backend": "torch"} | model_kwargs)),
        CacheConfig(block_size=4, num_blocks=128),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    ))
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list] = [[] for _ in prompts]
    while engine.has_work():
        for o in engine.step():
            i = int(o.request_id[1:])
            tokens[i].extend(o.new_token_ids)
            logprobs[i].extend(o.new_logprobs)
    return tokens, logprobs


def assert_matches(hf, prompt_tokens, tokens, logprobs, atol: float = LOGPROB_ATOL, steps: int = STEPS) -> None:
    assert_logprobs_match(hf_reference(hf, prompt_tokens, STEPS), tokens, logprobs, steps, atol)


def test_fp8_layers_stay_fp8_in_memory(checkpoint) -> None:
    """Every projection the checkpoint stores in FP8 is an FP8 parameter with its scales; the
    embeddings, norms and routers are not; the loaded scales are the checkpoint's."""
    family, _, path = checkpoint
    model = build_model(resolve_model(str(path)), "cpu", torch.float32)
    params = dict(model.named_parameters())
    stored = load_file(str(path / "model.safetensors"))
    fp8 = [n for n, p in params.items() if p.dtype == FP8_DTYPE]
    assert fp8 and all(n.endswith(("proj.weight", "gate_up_proj", "down_proj")) for n in fp8)
    assert not any(p.dtype == FP8_DTYPE for n, p in params.items() if "embed" in n or "norm" in n
                   or n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")))
    for name in fp8:
        if name.endswith(".weight"):
            assert torch.equal(params[name + "_scale_inv"], stored[name + "_scale_inv"]), name
            assert torch.equal(params[name].view(torch.uint8), stored[name].view(torch.uint8)), name
    if family == "tiny-qwen3-moe":
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.weight_block is not None


def test_single_request_matches_transformers(checkpoint) -> None:
    _, hf, path = checkpoint
    tokens, logprobs = run_engine(path, [PROMPTS[0]])
    assert_matches(hf, PROMPTS[0], tokens[0], logprobs[0])


def test_concurrent_batch_matches_transformers(checkpoint) -> None:
    _, hf, path = checkpoint
    tokens, logprobs = run_engine(path, PROMPTS)
    for p, t, lp in zip(PROMPTS, tokens, logprobs):
        assert_matches(hf, p, t, lp)


def test_fused_op_set_matches_transformers(checkpoint) -> None:
    """The Triton op set (W8A16 GEMM and FP8 MoE kernels, interpreted), merged projections
    included: their parts are not whole 128-row blocks, so they take one-row scale blocks."""
    _, hf, path = checkpoint
    steps = 6
    tokens, logprobs = run_engine(path, [PROMPTS[1]], steps=steps, attention_backend="triton")
    assert_matches(hf, PROMPTS[1], tokens[0], logprobs[0], atol=2e-3, steps=steps)


def test_quantization_none_dequantizes_on_load(checkpoint) -> None:
    _, hf, path = checkpoint
    model = build_model(resolve_model(str(path)), "cpu", torch.float32, quantization="none")
    assert not any(p.dtype == FP8_DTYPE for p in model.parameters())
    tokens, logprobs = run_engine(path, [PROMPTS[2]], steps=8, quantization="none")
    assert_matches(hf, PROMPTS[2], tokens[0], logprobs[0], steps=8)


def test_per_channel_checkpoint(tmp_path, hf_checkpoint) -> None:
    """Scales per output row (`weight_block_size` null, `[N, 1]` scales) load and match."""
    import transformers

    _, source = hf_checkpoint(tmp_path, "tiny-qwen3", seed=2468, router_std=0.5)
    write_fp8(source, tmp_path / "fp8", None, tmp_path / "dequantized")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).eval()
    model = build_model(resolve_model(str(tmp_path / "fp8")), "cpu", torch.float32)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == FP8_DTYPE and q_proj.weight_scale_inv.shape == (q_proj.out_features, 1)
    tokens, logprobs = run_engine(tmp_path / "fp8", [PROMPTS[0]])
    assert_matches(hf, PROMPTS[0], tokens[0], logprobs[0])


def test_quantize_on_load_matches_a_quantized_checkpoint(tmp_path, hf_checkpoint) -> None:
    """`--quantization fp8` on a float checkpoint holds the same layers in FP8 as the checkpoint
    quantized offline (the LM head and the routers stay exact), with the same bytes and scales
    where the blocks agree. The stacked experts (tiny: a projection is less than a 128-row
    block) are quantized in one-row blocks on load, finer than the offline 128-row ones: there
    both must dequantize to the float weights within e4m3's precision."""
    _, source = hf_checkpoint(tmp_path, "tiny-qwen3-moe", seed=2468, router_std=0.5)
    write_fp8(source, tmp_path / "fp8", BLOCK)
    on_load_model = build_model(resolve_model(str(source)), "cpu", torch.float32, quantization="fp8")
    on_load = dict(on_load_model.named_parameters())
    offline_model = build_model(resolve_model(str(tmp_path / "fp8")), "cpu", torch.float32)
    offline = dict(offline_model.named_parameters())
    assert on_load.keys() == offline.keys()
    for name, p in offline.items():
        assert p.dtype == on_load[name].dtype, name
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "_scale_inv")) and "experts" in name:
            continue
        a, b = (p.view(torch.uint8), on_load[name].view(torch.uint8)) if p.dtype == FP8_DTYPE else (p, on_load[name])
        assert torch.equal(a, b), name
    assert on_load["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    for model in (on_load_model, offline_model):
        experts = model.model.layers[0].mlp.experts
        w = dequantize(experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.weight_block)
        ref = torch.stack([torch.cat([load_file(str(source / "model.safetensors"))[
            f"model.layers.0.mlp.experts.{e}.{proj}.weight"] for proj in ("gate_proj", "up_proj")])
            for e in range(experts.num_experts)])
        assert ((w - ref).abs() <= ref.abs() * 2**-4 + ref.abs().max() * 2**-9).all()


def test_fp8_dummy_weights_serve() -> None:
    """A dummy model under `--quantization fp8`: FP8 parameters with finite, seeded weights."""
    model = build_model(resolve_model("dummy:tiny-qwen3-next"), "cpu", torch.float32, quantization="fp8")
    fp8 = [p for p in model.parameters() if p.dtype == FP8_DTYPE]
    assert fp8 and all(torch.isfinite(p.float()).all() and p.float().std() > 0.5 for p in fp8)
    tokens, _ = run_engine("dummy:tiny-qwen3-next", [PROMPTS[0]], steps=4, quantization="fp8")
    assert len(tokens[0]) == 4


def test_smollm2_quantized_on_load_answers_paris(smollm2_dir, hf_tokenizer) -> None:
    """The README's question through the real engine with the embedded SmolLM2 quantized to
    FP8 on load: greedy decoding still names Paris."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    engine = LLMEngine(EngineConfig(
        ModelConfig(model="smollm2-135m-instruct", attention_backend="torch", max_model_len=512, quantization="fp8"),
        CacheConfig(block_size=16, num_blocks=64), SchedulerConfig()))
    assert engine.runner.model.model.layers[0].self_attn.q_proj.weight.dtype == FP8_DTYPE
    engine.add_request("r0", list(ids), SamplingParams(max_tokens=16, temperature=0.0))
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert "Paris" in hf_tokenizer.decode(out)


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "qwen3-next-80b-a3b"])
def test_roofline_floor_counts_fp8_bytes(name) -> None:
    """The floor's weight bytes with FP8 projections: one byte per projection weight plus the
    block scales; routers, norms, embedding and LM head stay in the model dtype. Against the
    bf16 count: the same parameters, the projections' bytes scaled by (1 + 4/128²) / 2."""
    from tandem.bench import accounting

    shape = accounting.shape_from_hf_config(get_dummy_config(name))
    per_weight = accounting.fp8_bytes_per_weight(BLOCK, shape.hidden_size)
    assert per_weight == 1 + 4 / 128**2
    for batch in (1, 64):
        bf16 = accounting.decode_weight_bytes(shape, batch, 2)
        fp8 = accounting.decode_weight_bytes(shape, batch, 2, per_weight)
        projections = accounting.decode_weight_bytes(shape, batch, 0, 2)  # only the projections, in bf16
        kept = bf16 - projections
        assert fp8 == pytest.approx(kept + projections / 2 * per_weight, rel=1e-9)
        assert 0.5 * bf16 < fp8 < 0.7 * bf16  # the embedding and LM head stay bf16
