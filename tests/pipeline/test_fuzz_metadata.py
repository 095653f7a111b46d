"""Issue 15: a fuzz test of the metadata consumers. Each case mutates one spot of an artifact's
metadata JSON (and usually refreshes the manifest hash, as a careful attacker would); every
consumer must then give exit 1 or 2 with one error line and no traceback, or exit 0 with exactly
the untampered result — never a wrong result with exit 0.

The default run tries FUZZ_CASES mutations (a few seconds); `-m slow` tries FUZZ_CASES_SLOW."""

import copy
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ptxc.cli import main
from ptxc.pipeline.build import run_build
from ptxc.files import sha256
from ptxc.pipeline.metadata import dumps

FUZZ_CASES = 24
FUZZ_CASES_SLOW = 600
NAME = "fz"
SPEC = f"""
[[kernel]]
name = "{NAME}"
family = "decode"
dtype = "f32"
head_dim = 16
num_heads = 2
num_kv_heads = 1
num_splits = 2
return_lse = true
targets = ["sm_80"]
"""
ODD_VALUES = [None, True, False, 0, -1, 1, 3, 2**31, 2**64, 1e308, -0.5, "", "x" * 5000, "../x",
              "/etc/passwd", "a; } int evil(void){return 0;} /*", "batch", "cdiv(batch, 0)",
              "(" * 300 + "1" + ")" * 300, "max_seq_len * 1000000000000", "k_cache", "q", "o",
              "lse", "u64", "f16", "pointer", "dim", [], {}, [1, 2, 3], {"kind": "pointer"},
              "sm_80", "\n", "é", "ptxc_fz_split"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzmeta")
    (root / "k.toml").write_text(SPEC)
    run_build([root / "k.toml"], root / "out", verify=False, progress=False, cache_dir=root / "c")
    rng = np.random.default_rng(5)
    inputs = {"q": rng.standard_normal((2, 2, 16)).astype(np.float32),
              "k_cache": rng.standard_normal((2, 5, 1, 16)).astype(np.float32),
              "v_cache": rng.standard_normal((2, 5, 1, 16)).astype(np.float32),
              "seq_lens": np.array([4, 5], np.int32)}
    np.savez(root / "in.npz", **inputs)
    results = _consume(root / "out", root, root / "baseline")
    assert all(code == 0 for code, _ in results.values()), results
    return root, {k: v[1] for k, v in results.items()}


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def mutate(meta: dict, rng: random.Random) -> dict:
    meta = copy.deepcopy(meta)
    path = rng.choice([p for p in _paths(meta) if p])
    parent = meta
    for step in path[:-1]:
        parent = parent[step]
    key = path[-1]
    op = rng.choice(["replace", "replace", "replace", "delete", "add", "swap"])
    if op == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op == "add" and isinstance(parent, dict):
        parent[rng.choice(["extra", "x y", "../z", key + "_"])] = rng.choice(ODD_VALUES)
    elif op == "swap" and isinstance(parent, (list, dict)) and len(parent) > 1:
        keys = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
        other = rng.choice([k for k in keys if k != key])
        parent[key], parent[other] = parent[other], parent[key]
    else:
        parent[key] = rng.choice(ODD_VALUES)
    return meta


def _consume(out: Path, root: Path, work: Path) -> dict[str, tuple[int, object]]:
    """(exit code, result) of every consumer; on failure the result is the output text."""
    work.mkdir(parents=True, exist_ok=True)
    runs = {
        "run": (["run", str(out / NAME), "--inputs", str(root / "in.npz"), "--output",
                 str(work / "o.npz"), "--backend", "emu"], work / "o.npz"),
        "inspect": (["inspect", str(out / NAME), "--json"], None),
        "report": (["report", str(out / NAME), "--no-sass", "--json", "--shape", "batch=2,max_seq_len=5"], None),
        "emit-c-header": (["emit-c-header", str(out), "-o", str(work / "k.h")], work / "k.h"),
    }
    results = {}
    for name, (args, produced) in runs.items():
        r = CliRunner().invoke(main, args)
        if r.exit_code != 0:
            results[name] = (r.exit_code, r.output)
        elif name == "run":
            with np.load(produced) as z:
                results[name] = (0, {k: z[k].copy() for k in z.files})
        elif produced is not None:
            results[name] = (0, produced.read_text())
        else:
            results[name] = (0, r.output)
    return results


def _check_case(base, tmp_path: Path, seed: int) -> None:
    root, baseline = base
    out = tmp_path / f"case{seed}"
    shutil.copytree(root / "out", out)
    rng = random.Random(seed)
    meta_path = out / NAME / f"{NAME}.json"
    meta = mutate(json.loads(meta_path.read_text()), rng)
    try:
        raw = dumps(meta)
    except (ValueError, TypeError):
        return
    meta_path.write_bytes(raw)
    if rng.random() < 0.8:
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["artifacts"][NAME]["metadata_sha256"] = sha256(raw)
        (out / "manifest.json").write_bytes(dumps(manifest))
    for name, (code, result) in _consume(out, root, tmp_path / f"work{seed}").items():
        where = f"seed {seed}, {name}"
        if code == 0:
            if name == "run":
                assert result.keys() == baseline["run"].keys(), where
                for k in result:
                    np.testing.assert_array_equal(result[k], baseline["run"][k], err_msg=where)
            elif name == "emit-c-header":
                assert result == baseline[name], where
        else:
            assert code in (1, 2), (where, code, result)
            assert "Traceback" not in result and "internal error" not in result, (where, result)
            assert len([l for l in result.splitlines() if l.startswith("error:")]) == 1, (where, result)
    shutil.rmtree(out)


def test_metadata_consumers_fuzz(base, tmp_path):
    for seed in range(FUZZ_CASES):
        _check_case(base, tmp_path, seed)


@pytest.mark.slow
def test_metadata_consumers_fuzz_long(base, tmp_path):
    for seed in range(FUZZ_CASES, FUZZ_CASES + FUZZ_CASES_SLOW):
        _check_case(base, tmp_path, seed)
