"""The TCP pull transport alone over loopback, between two processes: the producer serves one
host buffer of Qwen3-8B-sized blocks (no device gather), the consumer receives into one reused host
array (no device write), so the GB/s is the wire path's: framing, CRC32, socket copies.
Usage: python3 -P bench/probes/kv_wire_probe.py [--blocks 512] [--reps 5] [--streams 1] [--no-crc]
(--streams: connections per pull, as `pull_parts` splits it; --no-crc replaces the CRC32 by a
constant on both ends: what the check costs)."""
import argparse, json, subprocess, sys, time

import numpy as np

import tandem.engine_service.kv_connector.tcp_transport as tt
from tandem.engine_service.kv_connector.auth import prompt_digest
from tandem.engine_service.kv_connector.leases import LeasedBlocks, LeaseTable

BLOCK_BYTES = 2359296  # Qwen3-8B, 16 tokens: 36 layers x K and V x 8 heads x 128 x bf16
DIGEST = prompt_digest((1,))

p = argparse.ArgumentParser()
p.add_argument("--blocks", type=int, default=512)
p.add_argument("--reps", type=int, default=5)
p.add_argument("--streams", type=int, default=1)
p.add_argument("--no-crc", action="store_true")
p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
a = p.parse_args()
if a.no_crc:
    tt.checksum = lambda data: 0
ids = list(range(a.blocks))
if a.serve:
    buf = np.random.default_rng(0).integers(0, 255, (a.blocks, BLOCK_BYTES), dtype=np.uint8)
    views = [memoryview(buf[j]).toreadonly() for j in ids]
    table = LeaseTable()
    leases = [table.grant(f"r{i}", LeasedBlocks(f"r{i}", [ids]), 600, prompt_digest=DIGEST) for i in range(a.reps)]
    srv = tt.KVPullServer("127.0.0.1", 0, table, lambda g, block_ids: [views[i] for i in block_ids]).start()
    print(json.dumps({"port": srv.port, "leases": [[x.lease_id, x.secret] for x in leases]}), flush=True)
    sys.stdin.read()
    srv.close()
    sys.exit(0)
child = subprocess.Popen([sys.executable, "-P", __file__, "--serve", *sys.argv[1:]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
line = child.stdout.readline()
while not line.startswith('{"port"'):
    line = child.stdout.readline()
hello = json.loads(line)
rows = np.ones((a.blocks, BLOCK_BYTES), dtype=np.uint8)
times = []
for lease_id, secret in hello["leases"]:
    socks = [tt.connect("127.0.0.1", hello["port"], 60) for _ in range(a.streams)]
    for sock in socks:
        sock.settimeout(60)
    t0 = time.perf_counter()
    tt.pull_parts(socks, lease_id, [ids], [BLOCK_BYTES], lease_secret=secret, prompt_digest=DIGEST, rows=[rows])
    times.append(time.perf_counter() - t0)
    for sock in socks:
        sock.close()
child.stdin.close()
child.wait()
nbytes = a.blocks * BLOCK_BYTES
print(json.dumps({"probe": "kv_wire", "crc": not a.no_crc, "streams": a.streams, "bytes": nbytes,
                  "gb_per_s": [round(nbytes / t / 1e9, 2) for t in times], "best_gb_per_s": round(nbytes / min(times) / 1e9, 2)}))
