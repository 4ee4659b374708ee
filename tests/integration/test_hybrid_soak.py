"""State accounting soak of a hybrid model (issue 11, acceptance 2), at engine level.

A tiny Qwen3.5 (Gated DeltaNet + gated attention, random weights saved by transformers) runs in
the engine with prefix caching and state checkpoints on, overlapped scheduling, and a KV pool
small enough to preempt. Requests sharing prefixes arrive at random; some are cancelled after a
few tokens, some aborted at any point (waiting or running), some carry a short deadline and are
aborted when it passes (what the frontend does; counted in engine steps, so the run does not
depend on how loaded the machine is), and the prefix cache is flushed now and then.
At the end every state slot, pending checkpoint and KV block is free, the engine's stats say so,
and the counts of what happened are printed.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.sequence import SamplingParams

BS = 4


@pytest.fixture
def torch_twins(monkeypatch):
    """The GDN kernels' PyTorch twins even under TRITON_INTERPRET=1 (speed; the kernels are
    compared with their twins in tests/kernels/)."""
    for name in ("causal_conv1d", "gated_delta_rule", "gated_norm"):
        module = importlib.import_module(f"tandem.kernels.{name}")
        monkeypatch.setattr(module, "use_triton", lambda device: device.type == "cuda")


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    import transformers

    from tandem.engine_service.dummy_configs import get_dummy_config

    cfg = get_dummy_config("tiny-qwen3.5")
    torch.manual_seed(99)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg)).float().eval()
    path = tmp_path_factory.mktemp("hybrid") / "tiny-qwen3.5"
    hf.save_pretrained(path)
    return path


def test_random_admission_cancel_abort_deadline_preemption_leave_every_slot_and_block_free(
        tiny_hybrid, torch_twins) -> None:
    rng = random.Random(2026)
    engine = LLMEngine(EngineConfig(
        ModelConfig(model=str(tiny_hybrid), attention_backend="torch", max_model_len=256),
        CacheConfig(block_size=BS, num_blocks=32, state_checkpoint_stride=2 * BS,
                    state_checkpoint_memory_fraction=0.5),
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_prefill_tokens_per_seq=8,
                        overlap_scheduling="on"),
    ))
    bm = engine.block_manager
    assert bm.checkpoints is not None and bm.checkpoints.num_slots >= 2
    bases = [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 50))] for _ in range(4)]
    live: dict[str, dict] = {}  # request id -> its plan (cancel after k tokens, deadline)
    counts = {"admitted": 0, "finished": 0, "cancelled": 0, "aborted": 0, "deadline": 0, "flushes": 0,
              "steps": 0}
    i = step = 0
    for step in range(400):
        if i < 120 and rng.random() < 0.4:
            prompt = rng.choice(bases)[: rng.randrange(4, 50)] + [rng.randrange(3, 300) for _ in range(rng.randrange(0, 6))]
            rid = f"r{i}"
            kind = rng.choices(["plain", "cancel", "abort", "deadline"], [4, 2, 1, 1])[0]
            plan = {"kind": kind, "tokens": 0, "cancel_after": rng.randrange(0, 4),
                    "deadline": step + rng.randrange(1, 25)}
            params = SamplingParams(max_tokens=rng.randrange(1, 16), temperature=rng.choice([0.0, 0.8]),
                                    ignore_eos=True, seed=rng.randrange(100))
            engine.add_request(rid, prompt, params)
            live[rid] = plan
            counts["admitted"] += 1
            i += 1
        for rid, plan in list(live.items()):
            kind = plan["kind"]
            if kind == "deadline" and step > plan["deadline"]:
                end = "deadline"
            elif kind == "abort" and rng.random() < 0.1:
                end = "aborted"
            elif kind == "cancel" and plan["tokens"] >= plan["cancel_after"]:
                end = "cancelled"
            else:
                continue
            if engine.abort(rid) is not None:
                counts[end] += 1
            live.pop(rid)
        if rng.random() < 0.01:
            assert bm.reset_prefix_cache()
            counts["flushes"] += 1
        for o in engine.step():
            plan = live.get(o.request_id)
            if plan is not None:
                plan["tokens"] += len(o.new_token_ids)
                if o.finished:
                    live.pop(o.request_id)
                    counts["finished"] += 1
        counts["steps"] += 1
    for rid in list(live):  # what is still running at the end is aborted, as a client would
        if engine.abort(rid) is not None:
            counts["aborted"] += 1
    while engine.has_work():
        engine.step()
    ck = bm.checkpoints
    stats = engine.stats()
    counts |= {"preemptions": engine.scheduler.num_preemptions, "prefix_hit_tokens": bm.prefix_hits,
               "prefix_kv_hit_tokens": bm.prefix_kv_hits, "checkpoint_saves": ck.num_saved,
               "checkpoint_restores": ck.num_restored, "checkpoints_evicted": ck.num_evicted}
    left = {"state_slots_used": stats.state_slots_used, "kv_blocks_used": stats.kv_blocks_used,
            "group_blocks_used": stats.group_blocks_used, "state_checkpoints_pending": stats.state_checkpoints_pending,
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "worker_rows": len(engine.worker.rows)}
    print("\nhybrid soak:", counts, "\nleft:", left, "\ncheckpoints registered:", ck.num_registered,
          "of", ck.num_slots)
    assert left == dict.fromkeys(left, 0), left
    assert bm.state_slots.num_free == bm.state_slots.num_slots
    assert all(p.num_free == p.num_blocks for p in bm.pools)
    assert ck.num_free + ck.num_registered == ck.num_slots and ck.num_pending == 0
    # The soak exercised what it claims to.
    assert counts["preemptions"] > 0 and counts["checkpoint_restores"] > 0 and counts["checkpoint_saves"] > 0
    for kind in ("finished", "cancelled", "aborted", "deadline"):
        assert counts[kind] > 0, kind
