# TEMPORARY tuning script (deleted after use)
import itertools, json, os, sys, torch
from tandem.kernels import paged_attention as pa, sampling as sp, gpu_check as gc
dev = torch.device("cuda"); gen = torch.Generator(device=dev); gen.manual_seed(0)
res = {}
def t(fn): return gc._time(fn, 3, 20, 5)["median_us"]
which = sys.argv[1]
if which in ("prefill", "all"):
    for cfg in [(64,64,4,2),(64,64,4,3),(128,64,8,2),(128,64,8,3),(128,32,4,2),(64,32,4,3),(128,128,8,2),(128,64,4,2)]:
        pa._prefill_config = lambda hd, cfg=cfg: cfg
        for ql, cx in [([1024],[1024]),([1024]*4,[1024]*4),([8192],[8192]),([512]*4,[8192]*4)]:
            try:
                c = gc._prefill_case(dev, gen, "x", ql, cx); c.run(); torch.cuda.synchronize()
                us = t(c.run); res[f"prefill {cfg} {len(ql)}x{ql[0]}/{cx[0]}"] = round(c.flops/us/1e6, 1)
            except Exception as e: res[f"prefill {cfg} {len(ql)}x{ql[0]}/{cx[0]}"] = repr(e)[:100]
        print(json.dumps(res), flush=True)
if which in ("decode", "all"):
    for cfg in [(64,4,2),(32,4,2),(64,4,3),(128,4,2),(64,8,2),(32,2,3),(16,4,3)]:
        pa._decode_config = lambda hd, cfg=cfg: cfg
        for B, ctx in [(1,8192),(16,8192),(64,8192),(256,8192),(1,1024),(64,1024),(256,1024)]:
            try:
                c = gc._decode_case(dev, gen, "q", 32, 8, 128, [ctx]*B, None); c.run(); torch.cuda.synchronize()
                us = t(c.run); res[f"decode {cfg} B{B}/{ctx}"] = (round(us,1), round(c.bytes_moved/us/1e3))
            except Exception as e: res[f"decode {cfg} B{B}/{ctx}"] = repr(e)[:100]
        print(json.dumps(res), flush=True)
if which in ("sampling", "all"):
    for npv, nw, blk in [(4,16,2048),(8,16,2048),(16,16,2048),(8,8,2048),(8,16,1024),(8,32,4096),(4,16,4096)]:
        sp._NUM_PIVOTS, sp._NUM_WARPS, sp._BLOCK = npv, nw, blk
        for c in gc._sampling_cases(False, dev, gen):
            try:
                c.run(); torch.cuda.synchronize(); ok = gc._check(c)["ok"]
                res[f"samp np{npv} w{nw} b{blk} {c.name}"] = (round(t(c.run),1), ok)
            except Exception as e: res[f"samp np{npv} w{nw} b{blk} {c.name}"] = repr(e)[:100]
        print(json.dumps(res), flush=True)
json.dump(res, open(os.path.join(os.environ["OUT"], f"tune_{which}.json"), "w"), indent=1)
