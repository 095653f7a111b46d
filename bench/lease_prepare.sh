#!/usr/bin/env bash
# Everything a short GPU lease needs, made here before it starts (bench/gpu_lease.py runs there):
#
#   bench/lease_prepare.sh            # -> gpu-art/arts.tgz (the artifact sets) and .whl/ (wheels)
#
# The sets are built here, with this machine's ptxas, so the cubins timed are the ones the SASS
# figures describe: gpuart (every example spec for its own targets), a90 (every example for
# sm_90a), ab (bench/lease_specs/hopper_ab.toml: the sm_90a prefill choices not yet timed, A/B)
# and dab (bench/lease_specs/decode_ab.toml: the decode and MLA choices).
# The device image has Python 3.12 with numpy, click, jinja2, rich, cuda-bindings and torch,
# but not these pure-Python dependencies of ptxc, which travel as wheels. Both folders are
# added to .git/info/exclude. Then, device calls carrying `.whl` and `gpu-art` (the H200 lease
# at 4078740: 537 s for everything through the main sets, then 98 s for the A/B set and 66 s
# for the 192 / 128 prefill on the still-warm machine, 748 s held of 900 with the start; what a
# deadline cuts goes on in a later call with the same command plus `--resume`). $OUT is emptied
# before every call and brings back at most 8 files: write --out under /tmp and copy each
# results.jsonl to $OUT under its own name (at 4078740 a whole folder's plan.json and
# results.jsonl were left out, and a second call fetched them while the machine was warm).
# The calls: first the machine constants of the model's sub-partition simulation
# (bench/microbench.py, ~10 s: latencies and issue intervals of FFMA, IMAD, MUFU, SHFL, the FP8
# cvt, LDS, LDSM, HMMA, and L2 / DRAM load latency, beside ptxc/report/issue_sim.py's table;
# it stopped with an illegal address at 4078740, fixed since: never run to the end yet), then
# the sm_80 images of the FP8 kernels JIT-compiled on the device (their e4m3 tiles hold f16
# subnormals for e4m3's subnormals: both passed at 4078740), then the MLA set: split scores
# (`*_split`) against the seesaw, the default since 4078740 timed it 8-18 % faster, at batch 64
# x 4096 unsplit and "auto" and at 16k keys -- add batch 16 and 128 shapes, which were not
# timed; the FP8 MLA decodes, dequantising warpgroup against every warp converting (`*_fused`:
# the warpgroup won by 6-11 %), `*_qk8_fp8s` (tile.fp8_scores: S on FP8 wgmma in three promoted
# chains at block_n 16, never timed; the one-chain tile of 4078740 was 1.25x faster than 16-bit
# products but failed the lse tolerance) against `*_qk8` (Q's e4m3 values on 16-bit), TP 8 against
# its 64-row tile and over e4m3_ds rows (`*_tp8_fp8_ds`: issue 25's 1.6x, never timed), and
# varlen d128's producer warpgroup against one issuer and three stages (one issuer won 0.4-4.4 %
# on one-token steps: time a d128 prefill chunk too).
# Then the main sets -- every example, sm_90a beside sm_90, at the shapes of issue 27 -- whose
# FP8 decode rows disagreed at 4078740 (llama3_8b_fp8_decode faster on the sm_90 cubin,
# qwen2_7b_fp8_head_decode on sm_90a: time both at batch 16 and 64), then the prefill A/B set
# (persistent CTAs and TMA stores: within +-4 % of the default at 4078740, `--every` times the
# whole set), then DeepSeek's 192 / 128 varlen prefill -- the 64-key tile (the default since the
# model's wgmma operand stall) against the 32-key one 4078740 timed (`_bn32`) and one issuer,
# and varlen d256 on 32- and 64-key tiles (`d256_serve`, `_bn64`: the same question):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD && mkdir -p /tmp/a && tar xzf gpu-art/arts.tgz -C /tmp/a &&
#   timeout 60 python3 bench/microbench.py --json $OUT/microbench.json;
#   timeout 60 python3 -m ptxc.cli launch-test --backend cuda --target sm_80 --json \
#       /tmp/a/gpuart/llama3_8b_fp8_decode /tmp/a/gpuart/deepseek_v3_mla_decode_fp8 > $OUT/fp8_sm80.json;
#   PYTHONUNBUFFERED=1 timeout 170 python3 bench/gpu_lease.py /tmp/a/dab /tmp/a/a90 --out /tmp/mla \
#       --only deepseek_v3_mla_decode_split,deepseek_v3_mla_decode,kimi_k2_mla_decode_split,kimi_k2_mla_decode,deepseek_v3_mla_decode_fp8,deepseek_v3_mla_decode_fp8_qk8,deepseek_v3_mla_decode_fp8_qk8_fp8s,deepseek_v3_mla_decode_fp8_fused,deepseek_v3_mla_decode_fp8_ds,deepseek_v3_mla_decode_fp8_ds_fused,deepseek_v32_mla_sparse_decode_fp8_sm90a,deepseek_v32_mla_sparse_decode_fp8_sm90a_fused,deepseek_v3_mla_decode_tp8,deepseek_v3_mla_decode_tp8_m64,deepseek_v3_mla_decode_tp8_fp8_ds,llama3_8b_serve,llama3_8b_serve_one,llama3_8b_serve_s3 \
#       --deadline 160 --item-timeout 40 --shape batch=64,total_q=64,max_pages_per_seq=64,num_pages=4096,num_splits=1 \
#       --shape batch=64,total_q=64,max_pages_per_seq=256,num_pages=16384;
#   PYTHONUNBUFFERED=1 timeout 180 python3 bench/gpu_lease.py /tmp/a/dab --out /tmp/mlap \
#       --only deepseek_v3_mla_prefill,deepseek_v3_mla_prefill_bn32,deepseek_v3_mla_prefill_one,d256_serve,d256_serve_bn64 --deadline 170 --item-timeout 40 \
#       --shape batch=4,total_q=16384,max_pages_per_seq=64,num_pages=256 \
#       --shape batch=1,total_q=16384,max_pages_per_seq=256,num_pages=256;
#   PYTHONUNBUFFERED=1 timeout 320 python3 bench/gpu_lease.py /tmp/a/a90 /tmp/a/gpuart --out /tmp/r \
#       --deadline 305 --item-timeout 30 --shape batch=1,seq_q=16384,seq_k=16384 \
#       --shape batch=64,max_seq_len=4096 --shape batch=64,max_pages_per_seq=256,num_pages=16384;
#   PYTHONUNBUFFERED=1 timeout 190 python3 bench/gpu_lease.py /tmp/a/ab --out /tmp/ab \
#       --only llama3_8b_prefill,llama3_8b_prefill_pers,llama3_8b_prefill_tmast,llama3_8b_prefill_pers_tmast,llama3_8b_prefill_nc,llama3_8b_prefill_nc_pers,llama3_8b_prefill_nc_tmast,mha_d64_bf16_prefill,mha_d64_bf16_prefill_pers,mqa_d256_prefill,mqa_d256_prefill_pers,deepseek_v3_prefill,deepseek_v3_prefill_pers \
#       --deadline 175 --item-timeout 30 --shape batch=4,seq_q=4096,seq_k=4096 --shape batch=1,seq_q=16384,seq_k=16384;
#   for d in mla mlap r ab; do cp /tmp/$d/results.jsonl $OUT/$d.jsonl; done
#
# (600 s a call at most: split them over calls when the machine is warm, each with its own
# --out; the MLA call alone is ~100 s.) `bench/calibration/add_run.py` adds the medians to
# the calibration set with the cubins that ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PTXC=${PTXC:-.venv/bin/ptxc}
for d in /.whl/ /gpu-art/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PTXC" build specs/ --out "$tmp/gpuart" > /dev/null
"$PTXC" build specs/ --target sm_90a --out "$tmp/a90" > /dev/null
"$PTXC" build bench/lease_specs/hopper_ab.toml --out "$tmp/ab" > /dev/null
"$PTXC" build bench/lease_specs/decode_ab.toml --out "$tmp/dab" > /dev/null
mkdir -p gpu-art .whl
tar czf gpu-art/arts.tgz -C "$tmp" gpuart a90 ab dab
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl platformdirs jsonschema jsonschema-specifications referencing rpds-py
echo "lease_prepare: gpu-art/arts.tgz ($(du -h gpu-art/arts.tgz | cut -f1)), $(ls .whl | wc -l) wheels in .whl/"
