"""`ptxc run --record-launches` and the graph-replay property it shows: two engine steps with
different batch compositions, padded to the same capture-time maxima (absent sequences have
seq_len 0), record byte-identical launches -- one captured launch list serves both, only device
buffer contents change -- and each step still computes the right answer (emulator vs fp64)."""

import json

import numpy as np
from click.testing import CliRunner

from conftest import build_kernel
from ptxc.cli import main
from ptxc import reference as ref
from ptxc.spec.model import KernelSpec

MAX_BATCH, MAX_SEQ, HEADS, KV, D = 4, 23, 4, 2, 64


def step(seq_lens, seed):
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((MAX_BATCH, HEADS, D)).astype(np.float16),
            "k_cache": rng.standard_normal((MAX_BATCH, MAX_SEQ, KV, D)).astype(np.float16),
            "v_cache": rng.standard_normal((MAX_BATCH, MAX_SEQ, KV, D)).astype(np.float16),
            "seq_lens": np.array(seq_lens, np.int32)}


def test_decode_steps_under_the_same_maxima_record_identical_launches(tmp_path):
    art = build_kernel(tmp_path, "decode", f'dtype = "f16"\nhead_dim = {D}\nnum_heads = {HEADS}\n'
                       f'num_kv_heads = {KV}\nnum_splits = "auto"\nreturn_lse = true')
    records = []
    for i, lens in enumerate(([5, 0, 17, 23], [1, 9, 0, 0])):
        inputs = step(lens, i)
        np.savez(tmp_path / f"in{i}.npz", **inputs)
        result = CliRunner().invoke(main, ["run", str(tmp_path / "out" / "k"), "--inputs",
                                           str(tmp_path / f"in{i}.npz"), "--output",
                                           str(tmp_path / f"out{i}.npz"), "--backend", "emu",
                                           "--record-launches", str(tmp_path / f"rec{i}.json")])
        assert result.exit_code == 0, result.output
        records.append((tmp_path / f"rec{i}.json").read_bytes())
        got = np.load(tmp_path / f"out{i}.npz")["o"].astype(np.float64)
        want = ref.decode(inputs["q"].astype(np.float64), inputs["k_cache"].astype(np.float64),
                          inputs["v_cache"].astype(np.float64), inputs["seq_lens"], D ** -0.5)
        live = np.array(lens) > 0
        want = want[0] if isinstance(want, tuple) else want
        assert np.abs(got[live] - want[live]).max() < 2e-3
        assert np.all(got[~live] == 0)                    # absent sequences: the CTAs exit, rows 0
    assert records[0] == records[1]
    launches = json.loads(records[0])["launches"]
    assert len(launches) == 2                               # split + reduce ("auto" splits > 1)
    pointers = {tuple(p["pointer"]) for rec in launches for p in rec["params"] if "pointer" in p}
    assert ("q", 0) in pointers and ("o", 0) in pointers


def test_varlen_mixed_batches_under_the_same_maxima_record_identical_launches(tmp_path):
    """Capture at max_batch sequences and max_total_q query rows: each step's real sequences,
    then one padding sequence (seq_len 0: its rows see no keys and come out 0) holding the
    spare rows, then absent sequences (q_len 0, seq_len 0)."""
    from ptxc.kernels import FAMILIES
    art = build_kernel(tmp_path, "varlen", 'dtype = "f16"\nhead_dim = 32\nnum_heads = 4\n'
                       'num_kv_heads = 2\ncausal = true\nnum_splits = "auto"\nreturn_lse = true\n'
                       'kv_layout = "contiguous"')
    spec = KernelSpec.from_dict(art.meta["spec"])
    max_batch, max_total_q, S = 5, 14, 19
    records = []
    for i, (q_lens, kv_lens) in enumerate((([1, 8, 3], [7, 8, 19]), ([4, 1], [0, 13]))):
        rng = np.random.default_rng(i)
        real = len(q_lens)
        q_lens = q_lens + [max_total_q - sum(q_lens)] + [0] * (max_batch - len(q_lens) - 1)
        kv_lens = kv_lens + [0] * (max_batch - len(kv_lens))
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        rnd = lambda *s: ref.round_to(rng.standard_normal(s), "f16").astype(np.float32)
        inputs = {"q": rnd(max_total_q, 4, 32), "k_cache": rnd(max_batch, S, 2, 32),
                  "v_cache": rnd(max_batch, S, 2, 32), "cu_seqlens_q": cu,
                  "seq_lens": np.array(kv_lens, np.int32)}
        rec = []
        out = art.run(inputs, target="sm_80", record=rec)
        records.append(json.dumps(rec, sort_keys=True))
        want = FAMILIES["varlen"].reference(spec, inputs)
        assert ref.max_abs_error(out["o"], want["o"]) < 2e-3
        assert np.all(out["o"][cu[real]:] == 0)            # the padding sequence's rows
    assert records[0] == records[1]
    assert [r["entry"] for r in json.loads(records[0])] == ["ptxc_k_split", "ptxc_k_reduce"]


def test_fused_decode_append_steps_record_identical_launches(tmp_path):
    """The fused append + split + reduce list over a paged cache: absent sequences have
    seq_len 0 and position -1 (the append skips the row, the split CTAs exit)."""
    from ptxc.kernels import FAMILIES
    art = build_kernel(tmp_path, "decode", 'dtype = "f16"\nhead_dim = 32\nnum_heads = 4\n'
                       'num_kv_heads = 2\nnum_splits = "auto"\nreturn_lse = true\n'
                       'kv_layout = "paged"\npage_size = 16\nappend_kv = true')
    spec = KernelSpec.from_dict(art.meta["spec"])
    dims = {"batch": 5, "max_pages_per_seq": 2, "num_pages": 13}
    records = []
    for i, lens in enumerate(([32, 0, 1, 17, 9], [0, 0, 5, 0, 0])):
        inputs = FAMILIES["decode"].make_inputs(spec, dims, np.random.default_rng(i))
        inputs["seq_lens"] = np.array(lens, np.int32)
        inputs["positions"] = np.array(lens, np.int32) - 1
        rec = []
        out = art.run(inputs, target="sm_80", record=rec)
        records.append(json.dumps(rec, sort_keys=True))
        want = FAMILIES["decode"].reference(spec, inputs)
        live = np.array(lens) > 0
        assert ref.max_abs_error(out["o"][live], want["o"][live]) < 2e-3
        assert np.all(out["o"][~live] == 0) and np.all(np.isneginf(out["lse"][~live]))
    assert records[0] == records[1]
    assert len(json.loads(records[0])) == 3                   # append, split, reduce


def test_graph_contract_in_the_metadata_is_rederived(tmp_path):
    """metadata `graph`: the dims the grids depend on, the capture dims, per-step inputs,
    workspaces and the vLLM graph class; a tampered contract is caught by the checked load."""
    from ptxc.pipeline.checked import check_artifact
    art = build_kernel(tmp_path, "decode", f'dtype = "f16"\nhead_dim = {D}\nnum_heads = {HEADS}\n'
                       f'num_kv_heads = {KV}\nnum_splits = "auto"\nreturn_lse = true\n'
                       'kv_layout = "paged"\npage_size = 16')
    g = art.meta["graph"]
    assert g["targets"]["sm_80"] == {"grid_depends_on": ["batch", "num_splits"],
                                     "class": "UNIFORM_SINGLE_TOKEN_DECODE"}
    assert g["capture_dims"] == ["batch", "max_pages_per_seq", "num_pages"]
    assert g["per_step_inputs"] == ["block_table", "seq_lens"]
    assert g["workspaces_rewritten"] == ["lse_part", "o_part"]
    path = art.path / "k.json"
    meta = json.loads(path.read_text())
    meta["graph"]["targets"]["sm_80"]["class"] = "ALWAYS"
    path.write_text(json.dumps(meta))
    _, problems = check_artifact(art.path, manifest=False)
    assert any("graph differs" in p for p in problems), problems
