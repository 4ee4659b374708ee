"""Measures how often the served model answers the README's question correctly, per sampling setting.

Runs against a running `tandem serve` (address as the first argument, default 127.0.0.1:50051):
for each candidate setting, 20 chat requests with seeds 0..19, counting answers that contain
"Paris". This is how the embedded model's shipped sampling defaults were chosen (see
`tandem/generation_defaults.py`).

    .venv/bin/python scripts/measure_chat_defaults.py 127.0.0.1:50051
"""

from __future__ import annotations

import json
import sys
import time

from tandem.client import TandemClient

QUESTION = "What is the capital of France?"
CANDIDATES = [
    {"temperature": 0.0},
    {"temperature": 0.2, "top_p": 0.9},
    {"temperature": 0.1, "top_p": 0.9},
    {"temperature": 0.3, "top_p": 0.8},
    {"temperature": 0.2, "top_p": 0.9, "top_k": 20},
    {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
    {"temperature": 1.0},
]


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    seeds = range(int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    with TandemClient(address) as client:
        for setting in CANDIDATES:
            start = time.monotonic()
            hits, tokens, samples = 0, 0, []
            for seed in seeds:
                reply = client.chat([{"role": "user", "content": QUESTION}], seed=seed, max_tokens=64, **setting)
                text = reply.choices[0].text
                hits += "Paris" in text
                tokens += reply.usage.completion_tokens
                if "Paris" not in text:
                    samples.append(text[:80])
            print(json.dumps({"setting": setting, "paris": f"{hits}/{len(seeds)}",
                              "mean_tokens": round(tokens / len(seeds), 1),
                              "seconds": round(time.monotonic() - start, 1), "misses": samples[:3]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
