"""The "auto" dim rules -- num_splits = "auto", and tile.persistent's persistent_ctas grid:
ptxc.runtime, the generated C header and the generated Rust module evaluate the metadata's rule
alike — per target, from that target's recorded occupancy of the kernel the rule names — over
batches, SM counts and targets."""

from __future__ import annotations

import shutil

import pytest

from conftest import require_rustc

from stubcuda import harness

from ptxc.pipeline.build import run_build
from ptxc.runtime import apply_dim_rule, load, rule_ctas_per_sm

SPECS = """
[[kernel]]
name = "rule_serve"
family = "varlen"
dtype = "f16"
head_dim = 128
num_heads = 32
num_kv_heads = 8
kv_layout = "paged"
num_splits = "auto"
targets = ["sm_80", "sm_90"]

[[kernel]]
name = "rule_decode"
family = "decode"
dtype = "f16"
head_dim = 128
num_heads = 32
num_kv_heads = 8
num_splits = "auto"
targets = ["sm_80", "sm_90"]

[[kernel]]
name = "rule_persistent"
family = "prefill"
dtype = "bf16"
head_dim = 128
num_heads = 32
num_kv_heads = 8
causal = true
targets = ["sm_80", "sm_90a"]
[kernel.tile]
persistent = true
"""
# kernel: (the dim its rule sets, the dim the second number of a case sets)
RULES = {"rule_serve": ("num_splits", "total_q"), "rule_decode": ("num_splits", None),
         "rule_persistent": ("persistent_ctas", "seq_q")}
CASES = [(batch, total_q, sms) for batch in (1, 3, 17, 64, 1000) for total_q in (1, 200)
         for sms in (1, 108, 132)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    missing = harness.toolchain_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("split_rule")
    (root / "s.toml").write_text(SPECS)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PTXAS", raising=False)
        run_build([root / "s.toml"], root / "out", verify=True, progress=False)
    return root, harness.build_stub(root / "stub")


def expected(root) -> list[str]:
    lines = []
    for name, (dim, second) in RULES.items():
        meta = load(root / "out" / name).meta
        rule = meta["dim_rules"][dim]
        for ti, target in enumerate(sorted(meta["targets"])):
            for batch, total_q, sms in CASES:
                n = apply_dim_rule(rule, {"batch": batch, second or "total_q": total_q}, sms,
                                   rule_ctas_per_sm(meta, rule, target))
                lines.append(f"{name} {ti} {batch} {total_q} {sms} {n}")
    return lines


def test_runtime_uses_each_targets_occupancy(built):
    root, _ = built
    meta = load(root / "out" / "rule_serve").meta
    rule = meta["dim_rules"]["num_splits"]
    occ = {t: rule_ctas_per_sm(meta, rule, t) for t in meta["targets"]}
    for t, got in occ.items():
        [k] = [k for k in meta["targets"][t]["kernels"] if k["entry"] == "ptxc_rule_serve_split"]
        assert got == k["occupancy"]["ctas_per_sm"] >= 1
    dims = {"batch": 3, "total_q": 3}
    assert {t: apply_dim_rule(rule, dims, 132, n) for t, n in occ.items()} == \
        {t: min(64, -(-4 * 132 * n // (8 * (3 * 4 // 64 + 3)))) for t, n in occ.items()}


def test_c_header_agrees_with_runtime(built, tmp_path):
    from ptxc.emit.cheader import emit
    root, stub = built
    header = emit(root / "out", tmp_path / "ptxc_kernels.h")
    body = []
    for name, (dim, second) in RULES.items():
        for ti in range(2):
            for batch, total_q, sms in CASES:
                extra = f" d.{second} = {total_q};" if second else ""
                body.append(f"    {{ ptxc_{name}_dims_t d; memset(&d, 0, sizeof d); d.batch = {batch};{extra}\n"
                            f"      L.target = {ti}; L.artifact = \"{name}\"; if (ptxc_{name}_resolve_dims(&L, &d, {sms}) != CUDA_SUCCESS) return 1;\n"
                            f'      printf("{name} {ti} {batch} {total_q} {sms} %lld\\n", (long long)d.{dim}); }}')
    src = ("#include <stdio.h>\n#include <string.h>\n" f'#include "{header}"\n'
           "int main(void) {\n    ptxc_loader_t L; memset(&L, 0, sizeof L);\n" + "\n".join(body)
           + "\n    return 0;\n}\n")
    out = harness.compile_and_run(src, tmp_path / "c", stub, cxx=False, args=[], env={})
    assert out.splitlines() == expected(root)


def test_rust_module_agrees_with_runtime(built, tmp_path):
    require_rustc()
    from ptxc.emit.rust import emit
    root, stub = built
    module = emit(root / "out", tmp_path / "ptxc_kernels.rs")
    body = []
    for name, (dim, second) in RULES.items():
        for ti in range(2):
            for batch, total_q, sms in CASES:
                extra = f" d.{second} = {total_q};" if second else ""
                body.append(f"    {{ let mut d = {name}::Dims::default(); d.batch = {batch};{extra}\n"
                            f"      {name}::resolve_dims(&mut d, {sms}, {ti}).expect(\"dims\");\n"
                            f'      println!("{name} {ti} {batch} {total_q} {sms} {{}}", d.{dim}); }}')
    src = f'#[path = "{module}"]\nmod kernels;\nuse kernels::*;\nfn main() {{\n' + "\n".join(body) + "\n}\n"
    out = harness.compile_rust_and_run(src, tmp_path / "rs", stub, args=[], env={})
    assert out.splitlines() == expected(root)


def test_cuda_backend_sizes_auto_with_the_device_sm_count(built):
    """Artifact.run(backend="cuda") resolves num_splits = "auto" with the device's
    MULTIPROCESSOR_COUNT (as the C/Rust loaders do with theirs), not the emulator's 108."""
    import numpy as np
    from ptxc.kernels import FAMILIES
    from ptxc.runtime import EMU_NUM_SMS
    from ptxc.spec.model import KernelSpec
    root, _ = built
    art = load(root / "out" / "rule_decode")
    spec = KernelSpec.from_dict(art.meta["spec"])
    family = FAMILIES[spec.family]
    dims = {**family.interface(spec).defaults, "batch": 3}
    inputs = family.make_inputs(spec, dims, np.random.default_rng(0))
    rule = art.meta["dim_rules"]["num_splits"]
    seen = []

    class FakeDevice:   # the launcher records the dims it is handed; no GPU needed
        def __init__(self, num_sms):
            self.num_sms = num_sms

        def launcher(self, artifact, target):
            return lambda kernel, buffers, d: seen.append(d["num_splits"])
    tname = art.target(None)[0]
    for sms in (1, 7, 132):
        seen.clear()
        art.run(inputs, backend="cuda", device=FakeDevice(sms))
        want = apply_dim_rule(rule, dims, sms,
                              rule_ctas_per_sm(art.meta, rule, tname))
        assert seen and set(seen) == {want}, (sms, seen, want)
    emu_want = apply_dim_rule(rule, dims, EMU_NUM_SMS, rule_ctas_per_sm(art.meta, rule, tname))
    assert {apply_dim_rule(rule, dims, s, rule_ctas_per_sm(art.meta, rule, tname)) for s in (1, 132)} != {emu_want}
