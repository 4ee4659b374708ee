"""`tandem bench report`: the disaggregation and KV-transfer sections."""

from __future__ import annotations

from tandem.bench.report import build_report
from tandem.bench.results import BenchRecord, write_record

ENV = {"timestamp": "2026-12-01T11:03:38Z", "device": {"name": "NVIDIA H200"}, "git": {"commit": "70463181de"}}


def _run(shape: str, itl_p99: float, pulled: int) -> dict:
    return {"shape": shape, "decode_itl_ms": {"p50": 5.0, "p99": itl_p99}, "short_ttft_ms": {"p50": 40.0, "p99": 250.0},
            "long_ttft_ms": {"p50": 600.0, "p99": 700.0}, "short_completed": 40, "long_completed": 8,
            "output_tokens_per_s": 4000.0, "kv_transfer": {"e": {"bytes_pulled": pulled}}}


def test_disagg_and_kv_transfer_tables(tmp_path):
    results = tmp_path / "results"
    disagg = BenchRecord(kind="disagg", model="dummy:qwen3-8b", env=dict(ENV))
    disagg.results = {"disagg": {"runs": [_run("single", 44.0, 0), _run("disaggregated", 17.6, 12_000_000_000)]}}
    write_record(disagg, results)
    kv = BenchRecord(kind="kv_transfer", model="dummy:qwen3-8b", env={**ENV, "timestamp": "2026-12-01T11:02:00Z"})
    kv.results = {"kv_transfer": {"ok": True, "parts": {
        "pull": {"bytes": 1_207_959_552, "device_copy": {"block_gather_scatter_gb_per_s": 288.0,
                                                          "contiguous_copy_gb_per_s": 2094.9},
                 "transports": {"cuda_ipc": {"bytes_equal": True, "gb_per_s": 129.6}}},
        "engines": {"transports": {"cuda_ipc": {"prompts_equal": 7, "near_ties": [{"prompt": 4}], "mismatches": []}}},
    }}}
    write_record(kv, results)
    md = tmp_path / "benchmarks.md"
    build_report(results, md, tmp_path / "plot.png")
    text = md.read_text()
    section = text.split("## Disaggregated prefill/decode")[1].split("## ")[0]
    single = next(line for line in section.splitlines() if "| single |" in line)
    disagg_row = next(line for line in section.splitlines() if "| disaggregated |" in line)
    assert "5.0 / 44.0" in single and "5.0 / 17.6" in disagg_row
    assert "2.50×" in disagg_row and "12.00" in disagg_row  # 44.0 / 17.6; GB pulled
    kv_section = text.split("## KV transfer between engine processes")[1].split("## ")[0]
    row = next(line for line in kv_section.splitlines() if "| cuda_ipc |" in line)
    assert "129.60" in row and "0.45×" in row and "7 equal, 1 near ties, 0 mismatches" in row
    assert "1208" in row  # MB pulled
