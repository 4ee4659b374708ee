"""`tandem plan` against the engine: its numbers are what a `ModelRunner` built from the same
flags allocates (weights, every cache group's blocks or slots and bytes), for a dense, a
sliding-window and a hybrid model, on the runner's CPU budget and on a planned GPU budget."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from tandem import cli, options
from tandem.engine_service.worker.model_runner import ModelRunner

MODELS = {
    "dense": "dummy:tiny-qwen3",
    "sliding-window": "dummy:tiny-qwen3-sw",
    "hybrid": "dummy:tiny-qwen3-next",
}
# Small pools so the sliding window's cap and the state checkpoints both matter.
FLAGS = ["--device", "cpu", "--block-size", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--max-model-len", "256", "--state-checkpoint-stride", "4"]


def plan_json(capsys, argv: list[str]) -> dict:
    assert cli.main(["--log-level", "warning", "plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def engine_config(argv: list[str]):
    """The EngineConfig `tandem engine` would build from these flags."""
    return cli._engine_config(options.parse_args(cli.build_parser(), ["engine", *argv]))


def parameter_bytes(model) -> int:
    """Bytes the built model's parameters occupy (shared storage once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def assert_plan_is_runners(plan: dict, runner: ModelRunner) -> None:
    memory = runner.memory_plan
    assert plan["weight_bytes"] == parameter_bytes(runner.model)
    assert plan["block_size"] == memory.block_size
    assert (plan["kv_cache_bytes"], plan["state_bytes"]) == (memory.kv_cache_bytes, memory.state_bytes)
    assert [g["name"] for g in plan["groups"]] == [g.name for g in memory.groups]
    for row, group in zip(plan["groups"], memory.groups):
        if group.paged:
            assert (row["num_blocks"], row["bytes_per_block"], row["sliding_window"]) == \
                (group.num_blocks, group.bytes_per_block, group.sliding_window)
            assert row["kv_tokens"] == group.num_blocks * memory.block_size
        else:
            assert (row["num_slots"], row["num_checkpoint_slots"], row["bytes_per_slot"]) == \
                (group.num_slots, group.num_checkpoint_slots, group.bytes_per_slot)
    # What the runner really allocated: the planned groups plus one scratch block / slot each.
    scratch = sum(g.bytes_per_block if g.paged else g.bytes_per_slot for g in memory.groups)
    assert runner.cache_tensors.total_bytes() == plan["kv_cache_bytes"] + plan["state_bytes"] + scratch


@pytest.mark.parametrize("kind", list(MODELS))
def test_plan_is_what_the_runner_allocates_on_cpu(kind, capsys) -> None:
    argv = ["--model", MODELS[kind], *FLAGS, "--cpu-kv-cache-gb", "0.0005"]
    plan = plan_json(capsys, argv)
    runner = ModelRunner(engine_config(argv))
    assert_plan_is_runners(plan, runner)
    kinds = {g["kind"] for g in plan["groups"]}
    assert {"dense": {"full_attention"}, "sliding-window": {"full_attention", "sliding_window"},
            "hybrid": {"full_attention", "state"}}[kind] == kinds
    if kind == "sliding-window":  # the window's cap left the full-attention group the rest
        window, full = (next(g for g in plan["groups"] if g["kind"] == k) for k in ("sliding_window", "full_attention"))
        assert window["num_blocks"] < full["num_blocks"]
    if kind == "hybrid":
        assert plan["groups"][-1]["num_checkpoint_slots"] > 0


@pytest.mark.parametrize("kind", list(MODELS))
def test_gpu_plan_is_what_the_runner_allocates_for_that_budget(kind, capsys) -> None:
    """`--gpu-memory`: the weights come off the GPU's memory, the cache takes its fraction of the
    rest, minus the activation reserve; a runner given exactly that cache budget allocates the
    planned groups."""
    argv = ["--model", MODELS[kind], *FLAGS, "--dtype", "bfloat16", "--kv-cache-memory-fraction", "0.8"]
    weights = plan_json(capsys, [*argv, "--gpu-memory", "1GiB"])["weight_bytes"]
    gpu = weights + 3 * 2**20
    plan = plan_json(capsys, [*argv, "--gpu-memory", str(gpu)])
    assert plan["device_memory_bytes"] == gpu
    assert plan["budget_bytes"] == int((gpu - weights) * 0.8)
    assert plan["reserved_bytes"] > 0
    config = engine_config(argv)
    # The CPU runner reserves nothing for activations and takes its budget as given.
    cache = dataclasses.replace(config.cache, cpu_kv_cache_bytes=plan["budget_bytes"] - plan["reserved_bytes"])
    runner = ModelRunner(dataclasses.replace(config, cache=cache))
    assert_plan_is_runners(plan, runner)


def test_concurrent_requests_are_bounded_by_the_fullest_group(capsys) -> None:
    plan = plan_json(capsys, ["--model", MODELS["dense"], *FLAGS, "--cpu-kv-cache-gb", "0.0005",
                              "--context-length", "8", "--context-length", "256"])
    blocks = plan["groups"][0]["num_blocks"]
    assert plan["requests"]["8"] == min(4, blocks // 2)
    assert plan["requests"]["256"] == min(4, blocks // 64)


def test_memory_sizes_parse() -> None:
    assert cli.parse_memory_size("141GiB") == 141 * 2**30
    assert cli.parse_memory_size("141GB") == 141 * 10**9
    assert cli.parse_memory_size("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_memory_size("lots")


def test_weights_that_do_not_fit_are_a_startup_error(capsys) -> None:
    assert cli.main(["--log-format", "console", "plan", "--model", MODELS["dense"], "--gpu-memory", "1KiB"]) == 2
    assert "do not fit" in capsys.readouterr().err
