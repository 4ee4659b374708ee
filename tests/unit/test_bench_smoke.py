"""Smoke tests of `tandem bench` on CPU: workloads, byte/FLOP accounting, the GPU guard, the
throughput run (engine alone and against the Hugging Face peer on the same tiny model), the
serving run through a real `tandem serve`, and the report generated from synthetic results."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.bench import accounting
from tandem.bench.workloads import make_workload
from tandem.engine_service.dummy_configs import get_dummy_config

TINY = "dummy:tiny-qwen3"


def _bench_args(*argv: str):
    from tandem.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def _run_bench(*argv: str) -> tuple[int, dict]:
    args = _bench_args(*argv)
    rc = args.fn(args)
    files = sorted(Path(args.out).glob(f"{args.bench_command}-*.json"))
    assert len(files) == 1, files
    return rc, json.loads(files[0].read_text())


# -- workloads -----------------------------------------------------------------------------------


def test_workloads_are_deterministic_prefix_stable_and_in_range():
    full = make_workload("nanovllm", vocab_size=500)
    assert len(full.requests) == 256
    assert full.params["standard"] is True
    for r in full.requests:
        assert 100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.output_len <= 1024
        assert 0 <= min(r.prompt_token_ids) and max(r.prompt_token_ids) < 500
    again = make_workload("nanovllm", vocab_size=500)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in full.requests]
    head = make_workload("nanovllm", vocab_size=500, num_prompts=4)
    assert head.requests == full.requests[:4] and head.params["standard"] is False
    more = make_workload("nanovllm", vocab_size=500, num_prompts=300)
    assert more.requests[:256] == full.requests
    # Lengths spread over the range rather than sitting on one value.
    assert len({r.output_len for r in full.requests}) > 100

    rk = make_workload("sharegpt-like-random", vocab_size=1000, num_prompts=3)
    assert rk.name == "random-1k"
    assert all(len(r.prompt_token_ids) == 1024 and r.output_len == 1024 for r in rk.requests)
    small = make_workload("random-1k", vocab_size=1000, num_prompts=2, scale=0.01)
    assert all(len(r.prompt_token_ids) == 10 and r.output_len == 10 for r in small.requests)
    clipped = make_workload("random-1k", vocab_size=1000, num_prompts=2, max_model_len=1500)
    assert all(len(r.prompt_token_ids) + r.output_len <= 1500 for r in clipped.requests)
    assert clipped.params["clipped_to_max_model_len"]["requests"] == 2


# -- accounting ----------------------------------------------------------------------------------


def test_qwen3_8b_decode_bytes_match_the_hand_count_and_the_guide():
    cfg = get_dummy_config("qwen3-8b")
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    # Per layer: q and o (h x heads*hd), k and v (h x kv_heads*hd), gate/up/down (h x inter),
    # two RMSNorm scales (h) and Qwen3's q/k norms (hd each). Then final norm and the LM head,
    # plus one embedding row per sequence (the table itself is not read at decode).
    per_layer = 2 * h * heads * hd + 2 * h * kv_heads * hd + 3 * h * inter + 2 * h + 2 * hd
    expected_b1 = 2 * (layers * per_layer + h + vocab * h + 1 * h)
    shape = accounting.shape_from_hf_config(cfg)
    assert accounting.decode_weight_bytes(shape, 1, 2) == expected_b1
    assert abs(expected_b1 / 1e9 - 15.1) < 0.1  # the guide's "≈15.1 GB of weights"
    assert accounting.decode_weight_bytes(shape, 256, 2) == expected_b1 + 2 * 255 * h

    per_token = 2 * layers * kv_heads * hd * 2  # K and V, bf16
    assert per_token == 144 * 1024  # the guide's "144 KiB per token"
    assert accounting.kv_bytes_per_token(shape, 2) == per_token
    assert accounting.decode_kv_bytes(shape, 16, 1024, 2) == 16 * 1024 * per_token

    # The guide's floors at ~4.3 TB/s: 3.2-3.6 ms at batch 1, 11-14 ms at batch 256 (1k context).
    bw = 4.3e12
    assert 3.2e-3 <= accounting.decode_floor_s(expected_b1, 1024 * per_token, bw) <= 3.6e-3
    b256 = accounting.decode_weight_bytes(shape, 256, 2) + accounting.decode_kv_bytes(shape, 256, 1024, 2)
    assert 11e-3 <= accounting.decode_floor_s(b256, 0, bw) <= 14e-3


def test_prefill_flops_and_param_count_against_independent_counts():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = get_dummy_config("qwen3-8b")
    shape = accounting.shape_from_hf_config(cfg)
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    matmul = 2 * h * heads * hd + 2 * h * kv_heads * hd + 3 * h * inter
    flops = accounting.prefill_flops(shape, [1024] * 8)
    assert flops["linear"] == 2 * layers * matmul * 8192
    assert flops["lm_head"] == 2 * vocab * h * 8  # logits only for each sequence's last token
    # Causal attention: QK^T and PV over 1024*1025/2 (query, key) pairs per head and layer.
    assert flops["attention"] == 8 * layers * 2 * 2 * heads * hd * (1024 * 1025 // 2)
    assert flops["total"] == flops["linear"] + flops["lm_head"] + flops["attention"]
    one_long = accounting.prefill_flops(shape, [8192])
    assert one_long["linear"] == flops["linear"] and one_long["attention"] > 7 * flops["attention"]

    # Parameter count: the Hugging Face model of the same config, built on the meta device.
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    assert accounting.total_params(shape) == sum(p.numel() for p in hf.parameters())


def test_sliding_window_floor_counts_only_the_window():
    """Acceptance 8's floor: Qwen3-8B shapes with every layer on a 1k window read, at 8k
    context, only the window's K/V; a mixed model counts the window on its windowed layers only."""
    full = accounting.shape_from_hf_config(get_dummy_config("qwen3-8b"))
    sw = accounting.shape_from_hf_config(get_dummy_config("qwen3-8b-sw1k"))
    assert sw.windows == (1024,) * 36
    per_token = 144 * 1024  # K and V of one token over 36 layers, bf16
    assert accounting.decode_kv_bytes(sw, 64, 8192, 2) == 64 * 1024 * per_token
    assert accounting.decode_kv_bytes(full, 64, 8192, 2) == 64 * 8192 * per_token
    assert accounting.decode_kv_bytes(sw, 64, 1000, 2) == 64 * 1000 * per_token  # shorter than the window
    assert accounting.decode_weight_bytes(sw, 64, 2) == accounting.decode_weight_bytes(full, 64, 2)
    mixed = accounting.shape_from_hf_config(get_dummy_config("tiny-qwen3-sw"))  # layer 0 full, 1-2 window 8
    layer_token = 2 * mixed.num_key_value_heads * mixed.head_dim * 4
    assert accounting.decode_kv_bytes(mixed, 3, 50, 4) == 3 * layer_token * (50 + 8 + 8)
    mistral = accounting.shape_from_hf_config(get_dummy_config("mistral-7b"))
    assert mistral.windows == (4096,) * 32


def test_windowed_causal_pairs_match_a_brute_force_count():
    for seq_len in (1, 5, 8, 9, 40):
        for window in (None, 1, 3, 8, 100):
            brute = sum(min(q + 1, window or q + 1) for q in range(seq_len))
            assert accounting.causal_pairs(seq_len, window) == brute
    sw = accounting.shape_from_hf_config(get_dummy_config("qwen3-8b-sw1k"))
    full = accounting.shape_from_hf_config(get_dummy_config("qwen3-8b"))
    assert accounting.causal_attention_flops(sw, 1024) == accounting.causal_attention_flops(full, 1024)
    assert accounting.causal_attention_flops(sw, 8192) < accounting.causal_attention_flops(full, 8192) / 4


def test_roofline_fake_plan_holds_only_window_blocks():
    from tandem.bench.roofline import RooflineOptions, fake_plan, plan_num_blocks, uniform_window
    from tandem.engine_service.cache.block_manager import NULL_BLOCK
    from tandem.engine_service.worker.worker_rows import WorkerRows, host_inputs_from_rows

    rng = np.random.default_rng(0)
    plan, aliased = fake_plan(4, 100, 1, 16, 4 * 3, 320, rng, window=24, num_groups=2)
    assert not aliased and plan.num_cache_groups == 2
    held = set()
    for req in plan.new_requests:
        tables = req.block_ids
        assert len(tables) == 2 and tables[0] == tables[1] and len(tables[0]) == 7
        # The query at position 99 sees 76..99: blocks 4..6; 0..3 are given back.
        assert tables[0][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in tables[0][4:]
        held.update(tables[0][4:])
    assert len(held) == 12  # distinct per sequence
    host = host_inputs_from_rows(WorkerRows(2).apply(plan), 16)
    assert host.block_tables.min() >= 0 and len(host.extra_groups) == 1
    np.testing.assert_array_equal(host.extra_groups[0][0], host.block_tables)
    # The pool the roofline asks for: batch 64 at 8k with a 1k window needs the window's blocks only.
    sw = accounting.shape_from_hf_config(get_dummy_config("qwen3-8b-sw1k"))
    assert uniform_window(sw) == 1024
    options = RooflineOptions(batches=[64], contexts=[8192], prefill_shapes=[(1, 1024)])
    plan = plan_num_blocks(sw, 2, 16, options, free_bytes=200 * 2**30, max_model_len=40960)
    assert plan["needed_blocks"] == 64 * (8192 // 16 - (8192 - 1 - 1024 + 1) // 16)


# -- GPU-only parts refuse clearly on CPU ---------------------------------------------------------


def test_gpu_only_measurements_raise_a_clear_error_on_cpu(tmp_path, capsys):
    from tandem.bench.roofline import measure_hbm_bandwidth, measure_matmul_rate
    from tandem.bench.timing import GPURequiredError, cuda_time

    cpu = torch.device("cpu")
    with pytest.raises(GPURequiredError, match="CUDA"):
        measure_hbm_bandwidth(cpu, nbytes=1 << 20)
    with pytest.raises(GPURequiredError, match="CUDA"):
        measure_matmul_rate(cpu, n=64)
    with pytest.raises(GPURequiredError, match="CUDA"):
        cuda_time(lambda: None, cpu)

    args = _bench_args("roofline", "--device", "cpu", "--model", TINY, "--out", str(tmp_path / "out"))
    assert args.fn(args) == 2
    assert "needs a CUDA" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no result file for a run that cannot happen


def test_roofline_drives_the_runner_through_a_step_plan(one_torch_thread, execute):
    """The roofline's fake batches reach the runner as the engine's do (a step plan applied to a
    worker's rows); on CPU the logits equal the Sequence-shaped input path's on the same tokens."""
    import numpy as np

    from tandem.bench.roofline import PlannedBatch, decode_path, fake_plan, make_worker
    from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tandem.engine_service.worker.model_runner import ModelRunner
    from tandem.engine_service.core.scheduler import ScheduledSeq
    from tandem.engine_service.sequence import Sequence

    runner = ModelRunner(EngineConfig(ModelConfig(model=TINY), CacheConfig(block_size=4, num_blocks=40),
                                      SchedulerConfig()))
    worker = make_worker(runner)
    plan, aliased = fake_plan(3, 10, 1, runner.block_size, runner.num_blocks, runner.vocab_size,
                              np.random.default_rng(0))
    assert not aliased and [r.block_ids for r in plan.new_requests] == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]]]
    with pytest.raises(ValueError, match="pool has"):
        fake_plan(20, 10, 1, runner.block_size, runner.num_blocks, runner.vocab_size, np.random.default_rng(0))
    planned = PlannedBatch(worker, plan)
    assert decode_path(runner, planned) == "eager" and len(worker.rows) == 3
    # The K/V the decode reads must exist: fill the caches with the prompts first (the same way).
    prefill, _ = fake_plan(3, 10, 10, runner.block_size, runner.num_blocks, runner.vocab_size,
                           np.random.default_rng(0), tag="-fill")
    filled = PlannedBatch(worker, prefill)
    filled.execute()
    filled.release()
    logits = planned.execute()
    again = planned.execute()  # a planned batch may be timed repeatedly: rows are not advanced
    torch.testing.assert_close(logits, again, atol=0, rtol=0)
    seqs = []
    for req in plan.new_requests:
        seq = Sequence(req.request_id, req.token_ids, req.sampling_params)
        seq.block_table, seq.num_computed_tokens = req.block_ids[0], req.num_computed_tokens
        seqs.append(ScheduledSeq(seq, 1, True))
    torch.testing.assert_close(logits, execute(runner, seqs), atol=0, rtol=0)
    assert logits.shape == (3, runner.vocab_size)
    planned.release()
    assert len(worker.rows) == 0


# -- throughput ----------------------------------------------------------------------------------


def test_throughput_engine_only_on_tiny_model(tmp_path, one_torch_thread, capsys):
    rc, data = _run_bench("throughput", "--model", TINY, "--workload", "nanovllm", "--num-prompts", "4",
                          "--scale", "0.05", "--no-peer", "--warmup-requests", "2", "--cpu-kv-cache-gb", "0.01",
                          "--out", str(tmp_path))
    assert rc == 0, data["errors"]
    assert data["schema"] == "tandem.bench/v1" and data["kind"] == "throughput" and data["complete"]
    for key in ("device", "torch", "transformers", "python", "git_commit", "timestamp"):
        assert data["env"].get(key), key
    res = data["results"]
    expected = make_workload("nanovllm", vocab_size=320, num_prompts=4, scale=0.05, max_model_len=512)
    assert res["workload"]["output_tokens"] == expected.num_output_tokens
    ours = res["ours"]
    assert ours["completed"] == 4 and not ours["timed_out"]
    assert ours["output_tokens"] == expected.num_output_tokens  # ignore_eos: every token counted
    assert ours["input_tokens"] == expected.num_input_tokens
    assert ours["requests_not_at_target_length"] == 0
    assert ours["output_tokens_per_s"] > 0 and ours["total_tokens_per_s"] > ours["output_tokens_per_s"]
    assert ours["prefix_cache_hits"] == 0  # warm-up prompts share nothing with the workload
    assert ours["step_ms"]["count"] == ours["steps"] and ours["step_ms"]["max"] > 0
    slowest = ours["slowest_steps_ms"]
    assert 1 <= len(slowest) <= 5 and slowest[0][1] == pytest.approx(ours["step_ms"]["max"], abs=0.01)
    assert "ratio" not in res
    assert "tandem engine" in capsys.readouterr().out.splitlines()[-2]


def test_throughput_against_hf_peer_on_the_same_weights(tmp_path, one_torch_thread):
    rc, data = _run_bench("throughput", "--model", TINY, "--num-prompts", "4", "--peer-num-prompts", "3",
                          "--scale", "0.05", "--warmup-requests", "2", "--cpu-kv-cache-gb", "0.01",
                          "--out", str(tmp_path))
    assert rc == 0, data["errors"]
    res = data["results"]
    peer, subset = res["peer"], res["ours_on_peer_subset"]
    expected = make_workload("nanovllm", vocab_size=320, num_prompts=4, scale=0.05, max_model_len=512).head(3)
    # The HF model computes the same function: its logits match the engine's on one prompt.
    assert peer["mode"] == "continuous_batching"  # transformers serves this model: the CB path
    check = peer["weights"]["logits_check"]
    assert check["verified"] and check["cosine"] > 0.9999 and check["same_argmax"]
    layers = peer["weights"]["layer_check"]  # and so does every layer, fed the engine's input
    assert layers["verified"] and len(layers["sublayer_cosine"]) == 2 and layers["min_sublayer_cosine"] > 0.9999
    assert peer["weights"]["verified"] and peer["weights"]["end_to_end_required"]  # dense: both checks count
    assert peer["weights"]["copied"] > 0
    # Same requests on both sides, each generating exactly its own output length.
    for side in (peer, subset):
        assert side["completed"] == 3 and not side["timed_out"]
        assert side["output_tokens"] == expected.num_output_tokens
        assert side["requests_not_at_target_length"] == 0
    assert peer["subset_of_workload"] is True and res["ours"]["completed"] == 4
    ratio = res["ratio"]
    assert ratio["on"] == "peer subset" and ratio["num_requests"] == 3 and ratio["comparable"]
    assert ratio["output_tokens_per_s"] == pytest.approx(subset["output_tokens_per_s"] / peer["output_tokens_per_s"])


# -- serve ---------------------------------------------------------------------------------------


def test_serve_through_grpc_and_in_process(tmp_path, one_torch_thread, monkeypatch):
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "1")  # the engine child, for the same reason
    rc, data = _run_bench("serve", "--model", TINY, "--concurrency", "1,2", "--requests-per-level", "2",
                          "--scale", "0.03", "--warmup-requests", "1", "--cpu-kv-cache-gb", "0.01",
                          "--level-seconds", "120", "--also-stack", "thread:stream:1", "--out", str(tmp_path))
    assert rc == 0, data["errors"]
    res = data["results"]
    assert res["server"]["exit_code"] == 0
    assert res["servers"]["thread:stream:1"]["exit_code"] == 0
    assert "--engine-core" in res["servers"]["thread:stream:1"]["argv"]
    levels = res["levels"]
    for level in levels:  # the old stack (core on a thread, stream transport) ran the same requests
        old = level["served_stacks"]["thread:stream:1"]
        assert old["served"]["completed"] == 2 and old["served"]["output_tokens"] == level["served"]["output_tokens"]
        assert old["ratio_output_tokens_per_s"] == pytest.approx(
            old["served"]["output_tokens_per_s"] / level["in_process"]["output_tokens_per_s"])
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    workload = make_workload("nanovllm", vocab_size=320, num_prompts=4, scale=0.03, max_model_len=512)
    for i, level in enumerate(levels):
        share = workload.requests[2 * i : 2 * i + 2]
        served, local = level["served"], level["in_process"]
        assert served["completed"] == 2 and served["failed"] == 0
        assert served["output_tokens"] == sum(r.output_len for r in share)
        assert local["output_tokens"] == served["output_tokens"]
        assert served["ttft_ms"]["p50"] > 0 and served["e2e_ms"]["count"] == 2
        assert level["ratio_output_tokens_per_s"] == pytest.approx(
            served["output_tokens_per_s"] / local["output_tokens_per_s"])
        engine = served["engine"]  # the served engine's own counters over the level
        assert engine["generation_tokens"] == served["output_tokens"]
        assert 0 < engine["steps"] <= served["output_tokens"] + len(share) * 40  # prefill chunks add steps
    assert "grpc_ttft_overhead_ms_c1" in res
    assert res["served_stack"] == {"engine_core": "process", "engine_transport": "mux", "frontend_workers": 1,
                                   "client_procs": 1, "client_procs_requested": 1}
    for level in levels:  # one process, one frontend: every request on the one worker
        spread = level["served"]["frontend_spread"]
        assert spread["workers_used"] == 1 and spread["balanced"]
        assert list(spread["requests_per_worker"]) == [str(p) for p in res["server"]["frontend_workers"]["pids"]]


def test_serve_merges_client_processes_over_two_frontend_workers(tmp_path, one_torch_thread, monkeypatch):
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "1")
    # Concurrency 3 over 2 client processes: 2 + 1 slots; 7 requests: the shared counter hands
    # them out in order wherever a slot frees up.
    rc, data = _run_bench("serve", "--model", TINY, "--concurrency", "3", "--requests-per-level", "7",
                          "--scale", "0.03", "--warmup-requests", "2", "--cpu-kv-cache-gb", "0.01",
                          "--level-seconds", "120", "--no-in-process", "--client-procs", "2",
                          "--frontend-workers", "2", "--out", str(tmp_path))
    assert rc == 0, data["errors"]
    res = data["results"]
    assert res["server"]["exit_code"] == 0
    assert res["served_stack"] == {"engine_core": "process", "engine_transport": "mux", "frontend_workers": 2,
                                   "client_procs": 2, "client_procs_requested": 2}
    workers = res["server"]["frontend_workers"]
    assert workers["requested"] == workers["reached"] == 2 and len(set(workers["pids"])) == 2
    assert "--frontend-workers" in res["server"]["argv"]
    share = make_workload("nanovllm", vocab_size=320, num_prompts=7, scale=0.03, max_model_len=512).requests
    served = res["levels"][0]["served"]
    # Every request sent is in the merged records exactly once, at its full length.
    assert served["num_requests"] == served["started"] == served["completed"] == 7
    assert served["failed"] == 0 and not served["timed_out"] and "client_errors" not in served
    assert served["client_procs"] == 2
    assert served["output_tokens"] == sum(r.output_len for r in share)
    assert served["input_tokens"] == sum(len(r.prompt_token_ids) for r in share)
    assert served["requests_not_at_target_length"] == 0
    assert served["ttft_ms"]["count"] == served["e2e_ms"]["count"] == 7
    assert served["tpot_ms"]["count"] == sum(1 for r in share if r.output_len > 1)
    assert 0 < served["itl_ms"]["count"] <= served["output_tokens"] - 7
    assert 0 < served["ttft_ms"]["p50"] <= served["e2e_ms"]["p50"] <= served["elapsed_s"] * 1e3
    assert served["output_tokens_per_s"] == pytest.approx(served["output_tokens"] / served["elapsed_s"])
    assert 0 < served["client_cpu_fraction"] and served["client_cpu_s"] > 0
    # Both frontend workers served, on the connections meant for them.
    spread = served["frontend_spread"]
    assert spread["frontend_workers"] == 2 and spread["balanced"] and spread["workers_used"] == 2
    assert set(spread["requests_per_worker"]) == {str(p) for p in workers["pids"]}
    assert sum(spread["requests_per_worker"].values()) == 7
    assert sum(spread["output_tokens_per_worker"].values()) == served["output_tokens"]
    assert spread["connections"] == 3  # one per (process, worker) its slots are meant for


def test_serve_rounds_alternate_live_sides_on_fresh_requests(tmp_path, one_torch_thread, monkeypatch):
    import statistics

    import tandem.bench.hf_peer as hf_peer
    import tandem.bench.serve as serve_mod
    import tandem.engine_service.core.engine as engine_mod

    monkeypatch.setenv("TANDEM_TORCH_THREADS", "1")
    # What starts and stops, in order: both sides must be alive across the rounds.
    events: list[str] = []

    class Server(serve_mod.ServeProcess):
        def __init__(self, *a, **kw):
            events.append("serve start")
            super().__init__(*a, **kw)

        def stop(self, *a, **kw):
            events.append("serve stop")
            return super().stop(*a, **kw)

    class Engine(engine_mod.LLMEngine):
        def __init__(self, *a, **kw):
            events.append("engine build")
            super().__init__(*a, **kw)

    real_release = hf_peer.release_device_memory
    monkeypatch.setattr(serve_mod, "ServeProcess", Server)
    monkeypatch.setattr(engine_mod, "LLMEngine", Engine)
    monkeypatch.setattr(hf_peer, "release_device_memory", lambda: (events.append("engine release"), real_release()))
    rc, data = _run_bench("serve", "--model", TINY, "--concurrency", "1,2", "--requests-per-level", "2",
                          "--rounds", "2", "--scale", "0.03", "--warmup-requests", "1", "--cpu-kv-cache-gb", "0.01",
                          "--level-seconds", "120", "--out", str(tmp_path))
    assert rc == 0, data["errors"]
    assert data["complete"]
    res = data["results"]
    assert events == ["serve start", "engine build", "engine release", "serve stop"]
    assert res["server"]["exit_code"] == 0
    assert res["options"]["rounds"] == 2 and res["workload"]["num_requests"] == 8  # 2 rounds x (2 + 2)
    orders = [["served", "in_process"], ["in_process", "served"]]
    assert [r["order"] for r in res["rounds"]] == orders and [r["round"] for r in res["rounds"]] == [0, 1]
    assert all(0 < r["seconds"] <= r["budget_s"] for r in res["rounds"])
    workload = make_workload("nanovllm", vocab_size=320, num_prompts=8, scale=0.03, max_model_len=512).requests
    for i, level in enumerate(res["levels"]):
        assert level["concurrency"] == i + 1 and level["num_requests"] == 2
        entries = level["rounds"]
        assert [e["round"] for e in entries] == [0, 1] and [e["order"] for e in entries] == orders
        shares = [workload[4 * r + 2 * i : 4 * r + 2 * i + 2] for r in (0, 1)]
        # Each round has its own requests (and the token counts checked below tell them apart).
        counts = [(sum(len(q.prompt_token_ids) for q in sh), sum(q.output_len for q in sh)) for sh in shares]
        assert counts[0] != counts[1]
        for entry, share in zip(entries, shares):
            assert "cut_short" not in entry
            for side in ("served", "in_process"):
                figures = entry[side]
                assert figures["completed"] == 2 and not figures["timed_out"]
                assert figures["output_tokens"] == sum(q.output_len for q in share)
                assert figures["input_tokens"] == sum(len(q.prompt_token_ids) for q in share)
            assert entry["ratio_output_tokens_per_s"] == pytest.approx(
                entry["served"]["output_tokens_per_s"] / entry["in_process"]["output_tokens_per_s"])
        assert entries[0]["served"]["engine"]["generation_tokens"] == entries[0]["served"]["output_tokens"]
        # The level's figures are the medians over the rounds, recomputed here.
        for side in ("served", "in_process"):
            med = level[side]
            assert med["median_of_rounds"] == [0, 1] and not med["timed_out"]
            for path in (("output_tokens_per_s",), ("elapsed_s",), ("ttft_ms", "p50"), ("ttft_ms", "p99"),
                         ("tpot_ms", "p50"), ("itl_ms", "p99"), ("e2e_ms", "p50")):
                values = []
                for entry in entries:
                    v = entry[side]
                    for k in path:
                        v = v[k]
                    values.append(v)
                got = med
                for k in path:
                    got = got[k]
                assert got == pytest.approx(statistics.median(values)), (side, path)
        assert level["ratio_output_tokens_per_s"] == pytest.approx(
            level["served"]["output_tokens_per_s"] / level["in_process"]["output_tokens_per_s"])
        paired = [e["ratio_output_tokens_per_s"] for e in entries]
        spread = level["ratio_rounds"]
        assert spread["values"] == pytest.approx(paired) and spread["rounds"] == [0, 1]
        assert spread["median"] == pytest.approx(statistics.median(paired))
        assert (spread["min"], spread["max"]) == (min(paired), max(paired))
    assert res["grpc_ttft_overhead_ms_c1"] == pytest.approx(
        res["levels"][0]["served"]["ttft_ms"]["p50"] - res["levels"][0]["in_process"]["ttft_ms"]["p50"])
    from tandem.bench.serve import short_table

    table = "\n".join(short_table(res))
    assert "2 rounds" in table and "(in-process first)" in table and "(served first)" in table


def test_serve_rounds_schedule_slices_and_medians_without_cut_short_rounds():
    from tandem.bench.serve_rounds import Step, round_slices, schedule, summarize_level_rounds

    # One round: each side opens, runs and closes before the next (the run before rounds).
    assert schedule(["served", "in_process"], 1) == [
        Step("open", "served"), Step("run", "served", 0), Step("close", "served"),
        Step("open", "in_process"), Step("run", "in_process", 0), Step("close", "in_process")]
    # More: all open first, the order reverses each round, all close last.
    steps = schedule(["served", "served[thread:stream:1]", "in_process"], 3)
    assert [s.action for s in steps[:3]] == ["open"] * 3 and [s.action for s in steps[-3:]] == ["close"] * 3
    assert [(s.round, s.side) for s in steps[3:-3]] == [
        (0, "served"), (0, "served[thread:stream:1]"), (0, "in_process"),
        (1, "in_process"), (1, "served[thread:stream:1]"), (1, "served"),
        (2, "served"), (2, "served[thread:stream:1]"), (2, "in_process")]
    with pytest.raises(ValueError):
        schedule(["served"], 0)
    slices = round_slices(list(range(10)), [1, 2], 3)
    assert slices == [[[0], [1, 2]], [[3], [4, 5]], [[6], [7, 8]]]
    with pytest.raises(ValueError):
        round_slices(list(range(8)), [1, 2], 3)

    def figures(tok_s: float, ttft_p99: float, **extra) -> dict:
        return {"num_requests": 4, "completed": 4, "timed_out": False, "output_tokens_per_s": tok_s,
                "ttft_ms": {"p50": ttft_p99 / 2, "p99": ttft_p99}, **extra}

    level = {"concurrency": 64, "num_requests": 4, "rounds": [
        {"round": 0, "order": ["served", "in_process"], "served": figures(90.0, 10.0), "in_process": figures(100.0, 8.0)},
        {"round": 1, "order": ["in_process", "served"], "served": figures(99.0, 30.0), "in_process": figures(90.0, 6.0)},
        # Cut short on one side: out of both sides' medians, still shown.
        {"round": 2, "order": ["served", "in_process"], "served": figures(50.0, 99.0, timed_out=True),
         "in_process": figures(100.0, 7.0)},
        {"round": 3, "order": ["in_process", "served"], "served": figures(96.0, 20.0),
         "in_process": {"status": "skipped", "reason": "time"}},
        {"round": 4, "order": ["served", "in_process"], "served": figures(100.0, 40.0), "in_process": figures(80.0, 9.0)},
    ]}
    summarize_level_rounds(level, ["served", "in_process"])
    rounds = level["rounds"]
    assert rounds[2]["cut_short"] == {"served": "timed out"} and rounds[3]["cut_short"] == {"in_process": "skipped"}
    assert all("cut_short" not in rounds[r] for r in (0, 1, 4))
    assert level["served"]["median_of_rounds"] == level["in_process"]["median_of_rounds"] == [0, 1, 4]
    assert level["served"]["output_tokens_per_s"] == 99.0 and level["in_process"]["output_tokens_per_s"] == 90.0
    assert level["served"]["ttft_ms"] == {"p50": 15.0, "p99": 30.0}  # each field's own median
    assert rounds[2]["ratio_output_tokens_per_s"] == 0.5  # shown, not counted
    assert level["ratio_rounds"] == {"median": 1.1, "min": 0.9, "max": 1.25, "rounds": [0, 1, 4],
                                     "values": [0.9, 1.1, 1.25]}
    # No usable round: no median, so no ratio.
    empty = {"concurrency": 1, "num_requests": 4, "rounds": [
        {"round": 0, "order": ["served", "in_process"], "served": figures(1.0, 1.0), "in_process": None}]}
    summarize_level_rounds(empty, ["served", "in_process"])
    assert empty["served"]["status"] == "no usable round" and "ratio_rounds" not in empty


def test_serve_rounds_on_a_gpu_need_a_fixed_kv_pool():
    from tandem.bench.results import Deadline, new_record
    from tandem.bench.serve import ServeOptions, run_serve
    from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    record = new_record("serve", TINY, {}, device="cpu")
    config = EngineConfig(ModelConfig(model=TINY, device="cuda"), CacheConfig(), SchedulerConfig())
    with pytest.raises(ValueError, match="--num-kv-blocks"):
        run_serve(record, config, [], ServeOptions(rounds=2), Deadline(10.0))
    assert "levels" not in record.results  # refused before anything started


def test_slot_plans_spread_concurrency_over_processes_and_workers():
    from tandem.bench.serve_client import auto_client_procs, plan_slots

    plans = plan_slots(10, 4, [101, 102, 103])
    assert [len(p) for p in plans] == [3, 3, 2, 2]  # the remainder goes to the first processes
    assert plans[0] == [101, 102, 103] and plans[1] == [102, 103, 101]  # each starts at another worker
    per_worker = Counter(w for p in plans for w in p)
    assert max(per_worker.values()) - min(per_worker.values()) <= 1
    assert plan_slots(1, 4, [7, 8]) == [[7]]  # never more processes than slots
    assert plan_slots(3, 1, []) == [[None, None, None]]  # no known workers: any
    assert [auto_client_procs(n) for n in (1, 2, 8, 16, 64)] == [1, 1, 2, 4, 4]


def test_merged_client_records_read_like_one_process():
    from tandem.bench.serve_client import ClientTiming, ShareResult, merge_shares
    from tandem.bench.workloads import BenchRequest

    requests = [BenchRequest([1, 2, 3], 3) for _ in range(4)]

    def timing(start: float) -> ClientTiming:
        return ClientTiming(start=start, prompt_len=3, target_output_len=3, tokens=3, chunks=3, first=start + 0.1,
                            last=start + 0.3, itl=[0.1, 0.1], done=True)

    a = ShareResult({0: timing(10.0), 2: timing(10.3)}, {0: 1, 2: 1}, [1], True, 10.0, 10.6, 0.2, False)
    b = ShareResult({1: timing(10.05)}, {1: 2}, [2], True, 10.05, 10.35, 0.5, False)
    s = merge_shares(requests, [a, b], [], 3, 2, 2)
    assert s["num_requests"] == 4 and s["started"] == s["completed"] == 3  # request 3 never started
    assert s["elapsed_s"] == pytest.approx(0.6)  # first start of any process to the last end
    assert s["output_tokens"] == 9 and s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 6 and s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["client_cpu_s"] == pytest.approx(0.7)
    assert s["client_cpu_fraction"] == pytest.approx(0.5 / 0.6)  # the busiest process
    assert s["frontend_spread"]["requests_per_worker"] == {"1": 2, "2": 1}
    assert s["frontend_spread"]["output_tokens_per_worker"] == {"1": 6, "2": 3}


# -- report --------------------------------------------------------------------------------------


def _synthetic(kind: str, model: str, results: dict, stamp: str) -> dict:
    env = {"device": "Test GPU 141GB", "torch": "9.9.0", "triton": "8.8.0", "transformers": "7.7.0",
           "python": "3.12.1", "git_commit": "0123456789abcdef0123", "git_dirty": False, "timestamp": stamp}
    return {"schema": "tandem.bench/v1", "kind": kind, "model": model, "env": env, "config": {},
            "results": results, "errors": [], "wall_s": 1.0, "complete": True}


def test_report_tables_carry_device_commit_workload_and_ratio(tmp_path):
    from tandem.bench.report import build_report

    results = tmp_path / "results"
    results.mkdir()
    roofline = {
        "bandwidth": {"bytes_per_s": 4.0e12}, "matmul": {"flops_per_s": 8.0e14},
        "runner": {"attention_backend": "triton"},
        "decode": [
            {"status": "ok", "batch": 1, "context": 1024, "median_ms": 4.0, "floor_ms": 3.4, "floor_pct": 85.0,
             "path": "cuda graph replay", "replay_only_ms": 3.8, "floor_pct_replay_only": 89.5},
            {"status": "ok", "batch": 16, "context": 1024, "median_ms": 5.0, "floor_ms": 4.0, "floor_pct": 80.0,
             "path": "cuda graph replay"},
            {"status": "skipped", "batch": 256, "context": 8192, "reason": "KV does not fit"},
        ],
        "prefill": [{"status": "ok", "shape": "8x1024", "tokens": 8192, "median_ms": 250.0,
                     "flops_per_s": 3.2e14, "mfu": 0.4}],
    }
    throughput = {
        "workload": {"name": "nanovllm", "num_requests": 256, "standard": True},
        "ours": {"output_tokens_per_s": 3000.0, "total_tokens_per_s": 6000.0},
        "peer": {"output_tokens_per_s": 2000.0, "total_tokens_per_s": 4000.0, "attn_implementation": "paged|sdpa"},
        "ratio": {"output_tokens_per_s": 1.5, "on": "full workload", "num_requests": 256, "comparable": True},
    }
    serve = {
        "workload": {"name": "nanovllm"}, "grpc_ttft_overhead_ms_c1": 1.25,
        "levels": [{"concurrency": 16, "num_requests": 32,
                    "served": {"completed": 32, "output_tokens_per_s": 950.0,
                               "ttft_ms": {"p50": 20.0, "p90": 30.0, "p99": 40.0},
                               "tpot_ms": {"p50": 5.0, "p90": 6.0, "p99": 7.0},
                               "itl_ms": {"p50": 5.0, "p90": 6.5, "p99": 9.0}},
                    "in_process": {"output_tokens_per_s": 1000.0}, "ratio_output_tokens_per_s": 0.95}],
    }
    for name, doc in (("roofline-qwen3-8b-1.json", _synthetic("roofline", "dummy:qwen3-8b", roofline, "2030-01-01T00:00:00Z")),
                      ("throughput-qwen3-0.6b-1.json", _synthetic("throughput", "dummy:qwen3-0.6b", throughput, "2030-01-01T00:00:01Z")),
                      ("serve-qwen3-0.6b-1.json", _synthetic("serve", "dummy:qwen3-0.6b", serve, "2030-01-01T00:00:02Z"))):
        (results / name).write_text(json.dumps(doc))
    # A later run of another served stack keeps its own rows; the run above (recorded before
    # the stack was) reads as stream transport, one frontend worker, one client process.
    scaled = json.loads(json.dumps(serve))
    scaled["served_stack"] = {"engine_core": "process", "engine_transport": "mux", "frontend_workers": 4,
                              "client_procs": 4}
    scaled["levels"][0]["ratio_output_tokens_per_s"] = 0.93
    # ... with the old stack measured beside it in the same call (--also-stack thread:stream:1).
    scaled["also_stacks"] = [{"engine_core": "thread", "engine_transport": "stream", "frontend_workers": 1,
                              "label": "thread:stream:1"}]
    scaled["levels"][0]["served"]["client_cpu_fraction"] = 0.31
    scaled["levels"][0]["served_stacks"] = {"thread:stream:1": {
        "served": {"completed": 32, "output_tokens_per_s": 500.0, "ttft_ms": {"p50": 60.0, "p90": 70.0, "p99": 80.0}},
        "ratio_output_tokens_per_s": 0.5}}
    scaled["also_stack_overheads"] = {"thread:stream:1": {"grpc_ttft_overhead_ms_c1": 9.5}}
    (results / "serve-qwen3-0.6b-2.json").write_text(
        json.dumps(_synthetic("serve", "dummy:qwen3-0.6b", scaled, "2030-01-01T00:00:03Z")))
    # A later throughput run of another workload does not hide the nanovllm row.
    random_1k = json.loads(json.dumps(throughput))
    random_1k["workload"] = {"name": "random-1k", "num_requests": 1000, "standard": True}
    random_1k["ratio"]["output_tokens_per_s"] = 2.5
    (results / "throughput-qwen3-0.6b-2.json").write_text(
        json.dumps(_synthetic("throughput", "dummy:qwen3-0.6b", random_1k, "2030-01-01T00:00:04Z")))
    (results / "notes.json").write_text("{not json")  # skipped, not fatal

    md, png = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks_decode.png"
    out = build_report(results, md, png)
    assert out["results"] == 5
    text = md.read_text()
    # Only the host-overhead table (no such result here) is empty.
    assert text.count("not measured yet") == 1
    assert text.index("not measured yet") > text.index("## Host overhead per engine step")
    rows = [line for line in text.splitlines() if line.startswith("| `dummy:")]

    def row_with(*needles: str) -> str:
        found = [r for r in rows if all(n in r for n in needles)]
        assert len(found) == 1, (needles, rows)
        return found[0]

    for needles in ((" 1 | 1024 ", "85.0%", "89.5%", "decode-sweep"), (" 16 | 1024 ", "80.0%"),
                    ("prefill 8x1024", "40.0%"), ("nanovllm (256 req)", "1.50×"), ("random-1k (1000 req)", "2.50×"),
                    ("| thread | stream | 1 | 1 | 16 |", "0.95×"), ("| process | mux | 4 | 4 | 16 |", "0.93×", "0.31"),
                    ("| thread | stream | 1 | 4 | 16 |", "0.50×", "60.0 / 70.0 / 80.0")):
        row = row_with(*needles)
        assert "Test GPU 141GB" in row and "`0123456789`" in row and "torch 9.9.0" in row
    assert "skipped" in row_with(" 256 | 8192 ")
    assert "20.0 / 30.0 / 40.0" in row_with("| 16 |", "0.95×")
    assert ("engine core thread, transport stream, 1 frontend worker(s), 1 client process(es): frontend + gRPC "
            "TTFT overhead") in text
    assert "1.25 ms" in text and "9.50 ms" in text
    assert "](benchmarks_decode.png)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_shows_the_median_ratio_of_a_run_in_rounds_beside_a_single_run(tmp_path):
    from tandem.bench.report import build_report

    results = tmp_path / "results"
    results.mkdir()
    stack = {"engine_core": "process", "engine_transport": "mux", "frontend_workers": 4, "client_procs": 4}
    single = {"workload": {"name": "nanovllm"}, "served_stack": stack, "options": {"rounds": 1},
              "levels": [{"concurrency": 64, "num_requests": 768,
                          "served": {"completed": 768, "output_tokens_per_s": 9000.0},
                          "in_process": {"output_tokens_per_s": 10000.0}, "ratio_output_tokens_per_s": 0.9}]}
    rounds = json.loads(json.dumps(single))
    rounds["options"]["rounds"] = 3
    rounds["levels"][0]["ratio_output_tokens_per_s"] = 0.97
    rounds["levels"][0]["ratio_rounds"] = {"median": 0.96, "min": 0.93, "max": 1.01, "rounds": [0, 1, 2],
                                           "values": [0.93, 0.96, 1.01]}
    for name, doc, stamp in (("serve-qwen3-0.6b-1.json", single, "2030-01-01T00:00:00Z"),
                             ("serve-qwen3-0.6b-2.json", rounds, "2030-01-01T00:00:01Z")):
        (results / name).write_text(json.dumps(_synthetic("serve", "dummy:qwen3-0.6b", doc, stamp)))
    md = tmp_path / "benchmarks.md"
    build_report(results, md, tmp_path / "plot.png")
    rows = [line for line in md.read_text().splitlines() if line.startswith("| `dummy:") and "| mux |" in line]
    assert len(rows) == 2  # the run in rounds does not replace the single run's row
    assert any("0.90×" in r and "rounds" not in r for r in rows)
    assert any("0.97× (medians of 3 rounds; per round median 0.96×, 0.93–1.01×)" in r for r in rows)
    assert "1 levels, 3 rounds" in md.read_text()


def test_report_without_results_says_not_measured(tmp_path):
    from tandem.bench.report import build_report

    md, png = tmp_path / "benchmarks.md", tmp_path / "benchmarks_decode.png"
    png.write_bytes(b"stale")
    out = build_report(tmp_path / "missing", md, png)
    text = md.read_text()
    assert out == {"markdown": str(md), "plot": None, "results": 0}
    assert text.count("not measured yet") == 6  # five tables and the history
    assert not png.exists() and ".png" not in text


# -- robustness ----------------------------------------------------------------------------------


def test_failures_and_time_limits_are_recorded_not_fatal(tmp_path, one_torch_thread):
    from tandem.bench.engine_run import run_engine
    from tandem.bench.results import Deadline, new_record, write_record
    from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tandem.engine_service.core.engine import LLMEngine

    record = new_record("throughput", TINY, {"note": "synthetic"}, device="cpu")
    with record.stage("first"):
        raise RuntimeError("boom")
    with record.stage("second"):
        record.results["second"] = "ran"
    assert record.results["second"] == "ran"
    assert [e["stage"] for e in record.errors] == ["first"] and "RuntimeError: boom" in record.errors[0]["error"]
    path = write_record(record, tmp_path)
    again = write_record(record, tmp_path)  # same timestamp: a second file, never an overwrite
    assert path != again and path.name.startswith("throughput-tiny-qwen3-")
    saved = json.loads(path.read_text())
    assert saved["complete"] is False and saved["errors"][0]["stage"] == "first"

    engine = LLMEngine(EngineConfig(ModelConfig(model=TINY, device="cpu"), CacheConfig(num_blocks=64),
                                    SchedulerConfig(max_num_seqs=8)))
    requests = make_workload("nanovllm", engine.vocab_size, num_prompts=3, scale=0.02).requests
    spent = run_engine(engine, requests, deadline=Deadline(0.0))
    assert spent.timed_out and spent.completed == [] and spent.summary()["timed_out"]
    assert not engine.has_work()  # in-flight requests were aborted; the engine is reusable
    done = run_engine(engine, requests, concurrency=2, id_prefix="again")
    assert not done.timed_out and len(done.completed) == 3
    assert sum(t.output_tokens for t in done.requests) == sum(r.output_len for r in requests)


def test_overhead_bench_times_decode_steps_with_every_sequence_running():
    from tandem.bench.overhead import measure_step_overhead
    from tandem.engine_service.config import EngineConfig

    point = measure_step_overhead(EngineConfig.default(model="host-only"), num_seqs=12, context=40, steps=5)
    assert point["running_during_timing"] == 12  # every sequence was decoding while timed
    assert point["steps_timed"] == 5
    assert 0 < point["host_ms_min"] <= point["host_ms_median"] <= point["host_ms_p90"]


def test_serve_mixed_workload_runs_once_per_prefill_cap(tmp_path, one_torch_thread, monkeypatch):
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "1")
    rc, data = _run_bench("serve", "--mixed", "--model", TINY, "--prefill-caps", "0,8", "--cpu-kv-cache-gb", "0.01",
                          "--mixed-decode-streams", "2", "--mixed-decode-output-len", "6", "--mixed-long-prompts", "2",
                          "--mixed-long-prompt-len", "200", "--mixed-long-interval", "0.2",
                          "--mixed-short-requests", "3", "--mixed-short-prompt-len", "8", "--mixed-short-interval",
                          "0.2", "--mixed-seconds", "120", "--out", str(tmp_path))
    assert rc == 0, data["errors"]
    mixed = data["results"]["mixed"]
    assert mixed["options"]["long_prompt_len"] == 200
    runs = mixed["runs"]
    assert [r["prefill_cap"] for r in runs] == [0, 8]
    assert [r["engine_prefill_cap"] for r in runs] == [0, 8]  # the flag reached each served engine
    for run in runs:
        assert not run["timed_out"] and run["errors"] == []
        assert run["short_completed"] == 3 and run["long_completed"] == 2
        assert run["short_ttft_ms"]["count"] == 3 and run["long_ttft_ms"]["count"] == 2
        assert run["decode_itl_ms"]["count"] > 0 and run["decode_itl_ms"]["p99"] > 0
    from tandem.bench.mixed import short_table

    table = short_table(data["results"])
    assert len(table) == 3 and "(off)" in table[1]


def test_soak_leak_check_reports_what_is_still_held():
    from tandem.bench.soak import leaks

    idle = {"frontend": {"in_flight": 0, "in_flight_choices": 0},
            "engines": {"e1": {"num_running": 0, "num_waiting": 0, "in_flight": 0, "kv_blocks_used": 0,
                               "kv_blocks_total": 100, "state_slots_used": 0}}}
    assert leaks(idle) == {}
    held = json.loads(json.dumps(idle))
    held["frontend"]["in_flight_choices"] = 2
    held["engines"]["e1"]["kv_blocks_used"] = 3
    held["engines"]["e1"]["state_slots_used"] = 1
    assert leaks(held) == {"frontend.in_flight_choices": 2, "e1.kv_blocks_used": 3, "e1.state_slots_used": 1}
    assert leaks({"engines": {"e2": {"error": "UNAVAILABLE"}}}) == {"e2.error": "UNAVAILABLE"}


def test_throughput_warmup_spans_the_workload_on_and_off_the_16_grid() -> None:
    from tandem.bench.throughput import engine_warmup

    workload = make_workload("nanovllm", vocab_size=320, num_prompts=16, scale=0.5, max_model_len=512)
    longest = max(len(r.prompt_token_ids) for r in workload.requests)
    warm = engine_warmup(320, workload, 2, max_model_len=512, step_tokens=1024)
    lens = sorted(len(r.prompt_token_ids) for r in warm)
    assert len(warm) >= 2 and lens[0] == 32 and 39 in lens and longest in lens
    assert sum(lens) >= 2 * 1024 and sum(lens) - max(lens) < 2 * 1024  # fills two steps, and no more
    assert len(engine_warmup(320, workload, 2, max_model_len=512, step_tokens=10**6)) == 256  # bounded
    assert max(lens) == min(longest + 7, 512 - 8) and all(r.output_len == 8 for r in warm)
    assert any(n % 16 for n in lens) and any(n % 16 == 0 for n in lens)
    assert not {tuple(r.prompt_token_ids[:8]) for r in warm} & {tuple(r.prompt_token_ids[:8]) for r in workload.requests}
