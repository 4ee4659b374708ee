"""Model resolution, GGUF conversion and caching, weight loading, dummy weights."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.engine_service.worker import loader
from tandem.engine_service.dummy_configs import dummy_config_names, get_dummy_config
from tandem.engine_service.worker.input_batch import build_model_inputs
from tandem.engine_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine_service.worker.loader import (
    WeightLoadError,
    build_model,
    init_dummy_weights,
    load_weights,
    read_eos_token_ids,
    resolve_model,
)
from tandem.engine_service.models.registry import get_model_class
from tandem.engine_service.sequence import SamplingParams, Sequence

# -- the real embedded model -----------------------------------------------------------------------


def test_embedded_gguf_converts_once_and_loads(smollm2_dir: Path, hf_model, monkeypatch) -> None:
    """`smollm2_dir` (session fixture) resolved the default spec through the default cache."""
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    # transformers loaded the converted directory (the hf_model fixture) without GGUF support.
    assert type(hf_model).__name__ == "LlamaForCausalLM"

    # A second resolve must reuse the cache: converting again would call the converter.
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_convert_gguf_into", no_conversion)
    mtime = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    again = resolve_model("smollm2-135m-instruct")
    assert time.monotonic() - start < 2.0
    assert Path(again.path) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert read_eos_token_ids(again) == (2,)  # <|im_end|>, the chat turn terminator

    # The published SmolLM2 hyperparameters in dummy_configs match the real file's.
    dummy = get_dummy_config("smollm2-135m")
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"]
    assert {k: dummy[k] for k in keys} == {k: config[k] for k in keys}
    assert config["rope_parameters"]["rope_theta"] == dummy["rope_theta"]


def test_smollm2_greedy_matches_transformers(smollm2_dir: Path, hf_model, hf_tokenizer) -> None:
    """Our paged model, decoding step by step, picks the same 16 greedy tokens as transformers."""
    ours = build_model(resolve_model(str(smollm2_dir)), "cpu", torch.float32)
    cfg = ours.config
    block_size = 16
    shape = (2, 32, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv_caches = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompts = [hf_tokenizer.encode(chat), hf_tokenizer.encode("The three primary colors are")]

    class Item:
        def __init__(self, seq: Sequence, n: int) -> None:
            self.seq, self.num_new_tokens, self.sample = seq, n, True

    next_free = 0
    for i, prompt in enumerate(prompts):
        seq = Sequence(str(i), prompt, SamplingParams(temperature=0.0))
        seq.block_table = list(range(next_free, next_free + 4))
        next_free += 4
        with torch.inference_mode():
            for _ in range(16):
                inputs = build_model_inputs([Item(seq, seq.num_uncomputed_tokens)], block_size, torch.device("cpu"))
                md = inputs.metadata
                hidden = ours(inputs.input_ids, md.positions, kv_caches, md)
                logits = ours.compute_logits(hidden[md.logits_indices])
                seq.num_computed_tokens = seq.num_tokens
                seq.append_token(int(logits.argmax(-1)))
            # Teacher-forced check, equivalent to comparing greedy outputs: one transformers
            # forward over prompt + our tokens must pick each of our tokens as its argmax.
            hf_next = hf_model(torch.tensor([seq.token_ids])).logits[0, len(prompt) - 1 : -1].argmax(-1)
        assert seq.output_token_ids == hf_next.tolist()
        if i == 0:
            assert "Paris" in hf_tokenizer.decode(seq.output_token_ids)


# -- resolution and conversion mechanics -------------------------------------------------------------


def test_resolve_dummy_and_errors(tmp_path: Path) -> None:
    resolved = resolve_model("dummy:tiny-qwen3")
    assert resolved.is_dummy and resolved.path is None
    assert get_model_class(resolved.config).__name__ == "Qwen3ForCausalLM"
    with pytest.raises(KeyError, match="tiny-qwen3"):  # the message lists the known names
        resolve_model("dummy:nope")
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path))  # a directory without config.json


def fake_converter(calls: list[Path], delay: float = 0.0, fail: bool = False):
    def convert(gguf_path: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(delay)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "source": gguf_path.name}))
        if fail:
            raise RuntimeError("conversion failed")

    return convert


def test_concurrent_resolves_convert_once(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert_gguf_into", fake_converter(calls, delay=0.3))
    cache = tmp_path / "cache"
    results: list[str] = []
    def resolve() -> None:
        results.append(resolve_model(str(gguf), str(cache)).path)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    target = Path(results[0])
    assert target.parent == cache and target.name.startswith("m-")
    assert json.loads((target / "config.json").read_text())["source"] == "m.gguf"
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # temp dir was renamed away

    # A modified file (new mtime) gets a fresh conversion in a new directory.
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert resolve_model(str(gguf), str(cache)).path != str(target)
    assert len(calls) == 2


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert_gguf_into", fake_converter(calls, fail=True))
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="conversion failed"):
        resolve_model(str(gguf), str(cache))
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    # The next attempt converts again (nothing half-written was mistaken for a finished cache).
    monkeypatch.setattr(loader, "_convert_gguf_into", fake_converter(calls))
    assert Path(resolve_model(str(gguf), str(cache)).path).is_dir()
    assert len(calls) == 2


def test_cache_root_follows_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "env-cache"))
    assert loader.default_cache_root() == tmp_path / "env-cache"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert loader.default_cache_root() == Path.home() / ".cache" / "tandem" / "models"


# -- weights ------------------------------------------------------------------------------------------


def tiny_checkpoint(tmp_path: Path, name: str = "tiny-qwen2") -> tuple[dict[str, torch.Tensor], Path]:
    """A checkpoint written from a dummy-initialised model, with its config.json."""
    model = build_model(resolve_model(f"dummy:{name}"), "cpu", torch.float32, seed=7)
    tensors = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("cos_sin_cache")}
    if get_dummy_config(name)["tie_word_embeddings"]:
        tensors.pop("lm_head.weight")
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(get_dummy_config(name)))
    return tensors, path


def test_load_weights_by_name_casts_and_ties(tmp_path: Path) -> None:
    tensors, path = tiny_checkpoint(tmp_path)
    assert any(k.endswith("q_proj.bias") for k in tensors)  # qwen2 has q/k/v bias
    # Split across two files in bf16, plus a stale rotary buffer that must be ignored.
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k].bfloat16() for k in names[:half]}, str(path / "a.safetensors"))
    rest = {k: tensors[k].bfloat16() for k in names[half:]}
    rest["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(rest, str(path / "b.safetensors"))
    model = build_model(resolve_model(str(path)), "cpu", torch.float32)
    state = model.state_dict()
    for k, v in tensors.items():
        assert state[k].dtype == torch.float32
        torch.testing.assert_close(state[k], v.bfloat16().float(), atol=0, rtol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("defect", ["missing", "unexpected", "misshapen"])
def test_load_weights_rejects_mismatched_checkpoints(tmp_path: Path, defect: str) -> None:
    tensors, path = tiny_checkpoint(tmp_path)
    if defect == "missing":
        del tensors["model.layers.1.mlp.down_proj.weight"]
    elif defect == "unexpected":
        tensors["model.layers.9.mlp.down_proj.weight"] = torch.zeros(2, 2)
    else:
        tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(path / "model.safetensors"))
    model = build_model(resolve_model("dummy:tiny-qwen2"), "cpu", torch.float32)
    with pytest.raises(WeightLoadError, match=defect):
        load_weights(model, path)


def test_load_weights_needs_safetensors(tmp_path: Path) -> None:
    model = build_model(resolve_model("dummy:tiny-llama"), "cpu", torch.float32)
    with pytest.raises(WeightLoadError, match="safetensors"):
        load_weights(model, tmp_path)


def test_dummy_weights_are_seeded_and_sane() -> None:
    a = build_model(resolve_model("dummy:tiny-qwen3"), "cpu", torch.float32, seed=1).state_dict()
    b = build_model(resolve_model("dummy:tiny-qwen3"), "cpu", torch.float32, seed=1).state_dict()
    c = build_model(resolve_model("dummy:tiny-qwen3"), "cpu", torch.float32, seed=2).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[q], c[q])
    assert abs(a[q].std().item() - 0.02) < 0.005 and abs(a[q].mean().item()) < 0.005
    for k in ("model.norm.weight", "model.layers.1.self_attn.k_norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(a[k], torch.ones_like(a[k]))
    bf16 = build_model(resolve_model("dummy:tiny-llama"), "cpu", torch.bfloat16, seed=1)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


def test_init_dummy_weights_overwrites_every_parameter() -> None:
    model = build_model(resolve_model("dummy:tiny-qwen2"), "cpu", torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    init_dummy_weights(model, seed=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# Published parameter counts (model cards); the real configs must reproduce them.
PUBLISHED_PARAMS = {"qwen3-0.6b": 0.596e9, "qwen3-8b": 8.19e9, "llama-3.1-8b": 8.03e9, "smollm2-135m": 134.5e6}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_real_dummy_configs_have_published_sizes(name: str) -> None:
    config = get_dummy_config(name)
    cls = get_model_class(config)
    with torch.device("meta"):  # shapes only, nothing allocated
        model = cls(cls.config_from_hf(config))
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.005, n
    assert name in dummy_config_names()


def test_sharded_linear_weight_loaders_split_the_checkpoint_tensor() -> None:
    full_w, full_b = torch.randn(8, 6), torch.randn(8)
    x = torch.randn(3, 6)
    cols = []
    for rank in range(2):
        col = ColumnParallelLinear(6, 8, bias=True, tp_rank=rank, tp_size=2)
        col.weight.weight_loader(col.weight, full_w)
        col.bias.weight_loader(col.bias, full_b)
        cols.append(col(x))
    torch.testing.assert_close(torch.cat(cols, dim=-1), x @ full_w.T + full_b)
    partial = []
    for rank in range(2):
        row = RowParallelLinear(8, 6, bias=False, tp_rank=rank, tp_size=2)
        row.weight.weight_loader(row.weight, full_w.T.contiguous())
        partial.append(torch.nn.functional.linear(torch.cat(cols, -1).chunk(2, -1)[rank], row.weight))
    torch.testing.assert_close(sum(partial), torch.cat(cols, -1) @ full_w)
