#!/usr/bin/env python3
"""Build the "auto" split rule's variants (split_plan.AUTO_WAVES x EQUAL_SPLITS) of the
decode-shaped kernels for a GPU lease, one artifact set per variant, kernel names suffixed.

    bench/split_rule_ab.py OUT W:EQ [W:EQ ...]     # e.g. 1:0 1:1 2:1 4:1 -> OUT/w1e0 ...

The constants change PTX only, and the checked loader re-derives each PTX from its spec, so a
set must be loaded (timed) with the constants it was built with: bench/gpu_lease.py
--patch ptxc.kernels.attention.split_plan:AUTO_WAVES=W --patch ...:EQUAL_SPLITS=EQ, one
gpu_lease run per set (this prints the commands). Each set is built in a cache of its own."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

SPECS = '''
[[kernel]]
name = "llama3_8b_decode_{v}"
family = "decode"
num_splits = "auto"
dtype = "f16"
head_dim = 128
num_heads = 32
num_kv_heads = 8
return_lse = true
targets = ["sm_90a"]

[[kernel]]
name = "llama3_8b_paged_decode_{v}"
family = "decode"
num_splits = "auto"
return_lse = true
dtype = "f16"
head_dim = 128
num_heads = 32
num_kv_heads = 8
kv_layout = "paged"
page_size = 16
targets = ["sm_90a"]

[[kernel]]
name = "llama3_8b_serve_{v}"
family = "varlen"
dtype = "f16"
head_dim = 128
num_heads = 32
num_kv_heads = 8
causal = true
kv_layout = "paged"
page_size = 16
num_splits = "auto"
return_lse = false
targets = ["sm_90a"]
'''
MODULE = "ptxc.kernels.attention.split_plan"


def main() -> int:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    for text in variants:
        w, eq = (int(x) for x in text.split(":"))
        v = f"w{w}e{eq}"
        pid = os.fork()
        if pid == 0:    # a fresh process per variant: constants and the cache are per process
            os.environ["PTXC_CACHE_DIR"] = tempfile.mkdtemp()
            from ptxc.kernels.attention import split_plan
            from ptxc.pipeline.build import run_build
            split_plan.AUTO_WAVES, split_plan.EQUAL_SPLITS = w, bool(eq)
            spec = Path(tempfile.mkdtemp()) / f"split_{v}.toml"
            spec.write_text(SPECS.format(v=v))
            s = run_build([spec], out / v, targets=[], verify=True, jobs=1, use_cache=False,
                          progress=False, shard=None, fatbin=False)
            os._exit(1 if s["problems"] else 0)
        _, status = os.waitpid(pid, 0)
        if status:
            print(f"split_rule_ab: {v} failed", file=sys.stderr)
            return 1
        print(f"python3 bench/gpu_lease.py SETS/{v} --every --patch {MODULE}:AUTO_WAVES={w} "
              f"--patch {MODULE}:EQUAL_SPLITS={eq} --out OUT/{v} --shape ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
