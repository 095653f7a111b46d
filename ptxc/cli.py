"""The `ptxc` command line. Imports are deferred into the commands so `ptxc --help` stays fast.

Exit codes: 0 success; 1 a failed verification or test; 2 a user error (bad spec, bad input,
missing toolchain) — always one clear message, never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from . import __version__


MAX_ERROR_CHARS = 2000   # an error echoes user input; never unboundedly much of it


class NonEmptyPath(click.Path):
    """click.Path that refuses an empty value: `-o ''` is Path('.'), the current directory,
    which no one means (a build would write its artifacts wherever the shell stands)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path names no file or directory", param, ctx)
        return super().convert(value, param, ctx)


def _fail(e, exit_code: int | None = None) -> None:
    from .errors import AssemblyError
    # One line, whatever the message holds (a file name with a newline, echoed input) — except
    # ptxas's rejection of generated PTX, a ptxc bug whose indented detail lines are the point.
    text = str(e) if isinstance(e, AssemblyError) else " ".join(str(e).split("\n"))
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS - 3] + "..."
    click.echo(f"error: {text}", err=True)
    sys.exit(e.exit_code if exit_code is None else exit_code)


def handles_errors(fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        from .env import env_flag
        from .errors import PtxcError
        debug = False
        try:
            debug = env_flag("PTXC_DEBUG")
            return fn(*a, **kw)
        except PtxcError as e:
            _fail(e)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except OSError as e:   # a file the user named: missing parent, read-only, full disk, ...
            where = f"{e.filename}: " if e.filename else ""
            _fail(f"{where}{e.strerror or e}", 2)
        except (RecursionError, MemoryError) as e:
            _fail(f"input too large or nested too deeply ({type(e).__name__})", 2)
        except Exception as e:   # a bug in ptxc: still one line, and the way to see more
            if debug:
                raise
            _fail(f"internal error ({type(e).__name__}: {e}); this is a ptxc bug - "
                  f"rerun with PTXC_DEBUG=1 for the traceback", 1)
    return wrapper




# click >= 8.2 raises this (a UsageError carrying the help text) for a group called without a
# command; older clicks print the help themselves
NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class OneLineErrors(click.Group):
    """Click's own usage errors (a missing argument, a bad option value) as one line naming the
    command, exit 2 -- as every other user error -- instead of usage, hint and message."""

    def main(self, *args, **kwargs):
        kwargs.pop("standalone_mode", None)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except NO_ARGS_IS_HELP as e:     # `ptxc` alone: the help, as click prints it
            click.echo(e.format_message(), err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "ptxc"
            click.echo(f"error: {where}: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)    # --help / --version: click's Exit code


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ptxc")
def main():
    """ptxc: compile attention-kernel specs (TOML) to verified PTX/cubin artifacts."""


@main.command()
@click.argument("paths", nargs=-1, required=True, type=NonEmptyPath(path_type=Path))
@click.option("--out", "-o", type=NonEmptyPath(path_type=Path), default=Path("out"), show_default=True,
              help="Output directory for artifact sets.")
@click.option("--target", "targets", multiple=True, help="Build for these targets instead of the specs' own.")
@click.option("--no-verify", is_flag=True, help="Skip ptxas (no cubins; metadata says verified: false).")
@click.option("--fatbin", is_flag=True, help="Also write <name>.fatbin per kernel: every target's cubin plus PTX.")
@click.option("-j", "--jobs", type=click.IntRange(1, 512), default=None, help="Parallel jobs [default: CPU count].")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the compilation cache.")
@click.option("--shard", default=None, metavar="I/N", help="Build only shard I of N (1-based; split by name hash).")
@handles_errors
def build(paths, out, targets, no_verify, fatbin, jobs, as_json, no_cache, shard):
    """Build every kernel in SPEC files / directories into OUT."""
    from .pipeline.build import run_build
    from .pipeline.shard import parse_shard
    summary = run_build(paths, out, targets=list(targets), verify=not no_verify, jobs=jobs,
                        use_cache=not no_cache, progress=not as_json,
                        shard=parse_shard(shard) if shard else None, fatbin=fatbin)
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
    else:
        from .report.console import print_build_summary
        print_build_summary(summary)
    if summary["problems"]:
        sys.exit(1)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=NonEmptyPath(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--rebuild", is_flag=True,
              help="Also rebuild every artifact from its recorded spec and compare byte for byte.")
@click.option("--allow-other-ptxas", is_flag=True,
              help="Accept cubins recorded as made by another ptxas than the installed one "
                   "without byte-comparing them (by default that fails: they cannot be compared).")
@handles_errors
def verify(paths, as_json, rebuild, allow_other_ptxas):
    """Re-check spec files, artifact directories or whole output directories (exit 1 on mismatch)."""
    from .pipeline.build import run_verify
    report = run_verify(paths, rebuild=rebuild, allow_other_ptxas=allow_other_ptxas)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, "problems": report.problems, "rows": report.rows,
                               "notes": report.notes},
                              indent=2, sort_keys=True))
    else:
        from .report.console import print_verify_report
        print_verify_report(report)
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("artifact_dir", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the checked metadata as JSON on stdout.")
@handles_errors
def inspect(artifact_dir, as_json):
    """Show an artifact's metadata in readable form (after the same checks as every consumer)."""
    from .report.console import print_inspect
    print_inspect(artifact_dir, as_json)


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print families and keys as JSON on stdout.")
@handles_errors
def list_families(as_json):
    """Kernel families with their spec keys, defaults and allowed values."""
    if as_json:
        from .report.console import families_data
        click.echo(json.dumps(families_data(), indent=2, sort_keys=True, default=str))
        return
    from .report.console import print_families
    print_families()


@main.group()
def cache():
    """The compilation cache (PTXC_CACHE_DIR, else the user cache directory)."""


@cache.command("path")
def cache_path():
    """Print the cache directory."""
    from .pipeline.cache import default_cache_dir
    click.echo(str(default_cache_dir()))


@cache.command("info")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON on stdout.")
@handles_errors
def cache_info(as_json):
    """Path, number of entries and total size (only files ptxc itself wrote are counted)."""
    from .pipeline.cache import Cache
    info = Cache(enabled=False).info()
    if as_json:
        click.echo(json.dumps(info, sort_keys=True))
    else:
        click.echo(f"path:    {info['path']}\nentries: {info['entries']}\nsize:    "
                   f"{info['bytes'] / 1e6:.2f} MB"
                   + ("" if info["is_ptxc_cache"] else "\n(not a ptxc cache: no CACHEDIR.TAG written by ptxc)"))


@cache.command("clear")
@handles_errors
def cache_clear():
    """Delete every entry ptxc wrote to the cache directory (and nothing else)."""
    from .pipeline.cache import Cache
    from .report.console import plural
    n = Cache(enabled=False).clear()
    click.echo(f"removed {plural(n, 'entry', 'entries')}")


@main.command(name="launch-test")
@click.argument("paths", nargs=-1, required=True, type=NonEmptyPath(exists=True, path_type=Path))
@click.option("--backend", type=click.Choice(["auto", "emu", "cuda"]), default="auto", show_default=True,
              help="Where to run: the PTX emulator, a CUDA device, or CUDA when one is present.")
@click.option("--shape", "shapes", multiple=True, help="Runtime dims, e.g. --shape batch=2,max_seq_len=113.")
@click.option("--target", "targets", multiple=True, help="Only these targets [default: all built].")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
              help="Seed of the random inputs.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@handles_errors
def launch_test(paths, backend, shapes, targets, seed, as_json):
    """Run kernels on random inputs and compare with the fp64 reference (exit 1 on failure)."""
    from .runtime.launch_test import TOLERANCE_RULE, launch_test as run, parse_assignments
    used, rows = run(paths, backend=backend, shapes=parse_assignments(shapes, "--shape"), seed=seed,
                     targets=list(targets) or None)
    if backend == "auto":
        click.echo(f"backend: {used}" + (" (no CUDA device found)" if used == "emu" else ""), err=True)
    if as_json:
        click.echo(json.dumps({"backend": used, "rule": TOLERANCE_RULE,
                               "results": [r.to_dict() for r in rows]}, indent=2, sort_keys=True))
    else:
        from .report.console import print_launch_test
        print_launch_test(rows, TOLERANCE_RULE)
    sys.exit(0 if rows and all(r.ok for r in rows) else 1)


@main.command()
@click.argument("artifact_dir", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--inputs", "inputs_path", required=True, type=NonEmptyPath(exists=True, dir_okay=False, path_type=Path),
              help=".npz with one array per input tensor (names as in `ptxc inspect`).")
@click.option("--output", "output_path", required=True, type=NonEmptyPath(dir_okay=False, path_type=Path),
              help=".npz to write the output tensors to.")
@click.option("--target", default=None, help="Which target's PTX/cubin [default: oldest built].")
@click.option("--backend", type=click.Choice(["auto", "emu", "cuda"]), default="auto", show_default=True,
              help="Where to run: the PTX emulator, a CUDA device, or CUDA when one is present.")
@click.option("--set", "sets", multiple=True,
              help="Runtime dims not inferable from inputs, or runtime scalars (k_scale): name=value.")
@click.option("--record-launches", "record_path", default=None, type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Also write every launch (entry, grid, block, dynamic smem, parameter bytes with "
                   "device pointers as [buffer, byte offset]) to this JSON file.")
@handles_errors
def run(artifact_dir, inputs_path, output_path, target, backend, sets, record_path):
    """Run an artifact's launch list on the tensors in an .npz; write the outputs to an .npz."""
    from .runtime.launch_test import parse_assignments, run_npz
    from .pipeline.artifacts import ensure_output_file
    from .runtime.launch_test import progress_notes
    ensure_output_file(output_path, "--output")
    if record_path is not None:
        ensure_output_file(record_path, "--record-launches")
    with progress_notes(f"{artifact_dir.name}"):
        info = run_npz(artifact_dir, inputs_path, output_path, target=target, backend=backend,
                       sets=parse_assignments(sets, "--set", floats=True), record_path=record_path)
    click.echo(f"{output_path}: " + ", ".join(f"{k} {v}" for k, v in info["outputs"].items())
               + f" (backend {info['backend']})")


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--out", "-o", required=True, type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Output directory to merge into (created if missing).")
@handles_errors
def merge(inputs, out):
    """Merge several build output directories (e.g. shards) into one artifact set."""
    from .emit.distribute import merge as do_merge
    info = do_merge(list(inputs), out)
    click.echo(f"merged {info['artifacts']} artifacts from {len(inputs)} directories into {out}")


@main.command()
@click.argument("src", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--output", "-o", required=True, type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Path of the .tar.gz to write.")
@handles_errors
def pack(src, output):
    """Write a reproducible .tar.gz of an output directory (sorted, fixed mtimes and owners)."""
    from .emit.distribute import pack as do_pack
    from .pipeline.artifacts import ensure_output_file
    ensure_output_file(output, "--output")
    info = do_pack(src, output)
    click.echo(f"{output}: {info['files']} files, sha256 {info['sha256']}")


@main.command(name="emit-c-header")
@click.argument("out_dir", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--output", "-o", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="Header path [default: OUT_DIR/ptxc_kernels.h].")
@click.option("--prefix", default=None,
              help="Name of the header's variant lookup: ptxc_PREFIX_find_variant [default: set_ and a hash of "
                   "its artifact names].")
@handles_errors
def emit_c_header(out_dir, output, prefix):
    """Write a C loader header (per-target launch lists, image choice at load, preconditions)."""
    from .emit.cheader import emit
    if output is not None:
        from .pipeline.artifacts import ensure_output_file
        ensure_output_file(output, "--output")
    click.echo(str(emit(out_dir, output, prefix)))


@main.command(name="emit-rust")
@click.argument("out_dir", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--output", "-o", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="Module path [default: OUT_DIR/ptxc_kernels.rs]; images are embedded relative to it.")
@handles_errors
def emit_rust(out_dir, output):
    """Write a self-contained Rust module (no crates; images embedded) for an artifact set."""
    from .emit.rust import emit
    if output is not None:
        from .pipeline.artifacts import ensure_output_file
        ensure_output_file(output, "--output")
    click.echo(str(emit(out_dir, output)))


# --- performance: static report (no GPU), GPU bench and tuner (docs/performance.md) ---

@main.command()
@click.argument("paths", nargs=-1, required=True, type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
@click.option("--shape", "shapes", multiple=True,
              help="Runtime dims for the cost model, e.g. --shape batch=32,max_seq_len=8192.")
@click.option("--gpu", "gpus", multiple=True,
              help="Roofline on these GPU models (ptxc/report/gpus.py) [default: the models of each target's SM].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--html", "html_path", type=NonEmptyPath(dir_okay=False, path_type=Path), default=None,
              help="Also write a self-contained HTML page with roofline plots.")
@click.option("--measured", multiple=True, type=NonEmptyPath(exists=True, dir_okay=False, path_type=Path),
              help="`ptxc bench --json` output whose ptxc rows are drawn on the rooflines.")
@click.option("--no-sass", is_flag=True, help="Skip the SASS instruction mix (nvdisasm).")
@handles_errors
def report(paths, shapes, gpus, as_json, html_path, measured, no_sass):
    """Static performance report of artifacts: resources, occupancy, cost, roofline, SASS mix."""
    from .runtime.launch_test import parse_assignments
    from .report.analysis import build_report, load_measured, write_html
    if html_path:
        from .pipeline.artifacts import ensure_output_file
        ensure_output_file(html_path, "--html")
    data = build_report(paths, shapes=parse_assignments(shapes, "--shape"), gpus=list(gpus) or None,
                        measured=load_measured(measured) if measured else None, sass=not no_sass)
    if html_path:
        write_html(data, html_path)
        click.echo(f"wrote {html_path}", err=True)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        from .report.tables import print_report
        print_report(data)


@main.command(name="bench")
@click.argument("paths", nargs=-1, required=True, type=NonEmptyPath(exists=True, path_type=Path))
@click.option("--shape", "shapes", multiple=True, help="Runtime dims, e.g. --shape batch=4,seq_q=4096,seq_k=4096.")
@click.option("--target", default=None, help="Which target's image [default: the device's SM].")
@click.option("--warmup", type=click.IntRange(0, 10000), default=10, show_default=True, help="Untimed runs first.")
@click.option("--repeat", type=click.IntRange(1, 100000), default=50, show_default=True, help="Timed runs.")
@click.option("--l2-flush/--no-l2-flush", "flush", default=None,
              help="Flush L2 before each timed run [default: for decode only].")
@click.option("--no-compare", is_flag=True, help="Skip torch SDPA / flash-attn side by side.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@handles_errors
def bench_cmd(paths, shapes, target, warmup, repeat, flush, no_compare, as_json):
    """Time specs or artifacts on the GPU (CUDA events); TFLOP/s, GB/s and % of peak."""
    from .gpu.bench import run_bench
    from .runtime.launch_test import parse_assignments
    result = run_bench(paths, shapes=parse_assignments(shapes, "--shape"), target=target, warmup=warmup,
                       repeat=repeat, flush=flush, compare=not no_compare)
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        from .report.tables import print_bench
        print_bench(result)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=NonEmptyPath(exists=True, path_type=Path))
@click.option("--target", default=None, help="Target to tune [default: the spec's target for the device's SM].")
@click.option("--shape", "shapes", multiple=True, help="Runtime dims to tune at.")
@click.option("--out", "out_dir", type=NonEmptyPath(file_okay=False, path_type=Path), default=None,
              help="Directory of the tuned table [default: ptxc/tuned/ in the package].")
@click.option("--warmup", type=click.IntRange(0, 1000), default=5, show_default=True, help="Untimed runs per candidate.")
@click.option("--repeat", type=click.IntRange(1, 10000), default=20, show_default=True, help="Timed runs per candidate.")
@click.option("--limit", type=click.IntRange(1, 10000), default=None, help="Try at most N candidates per key.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@handles_errors
def tune(paths, target, shapes, out_dir, warmup, repeat, limit, as_json):
    """Time every legal tile of SPEC on the GPU; write the fastest per key to a tuned table."""
    from .runtime.launch_test import parse_assignments
    from .gpu.tune import run_tune
    result = run_tune(paths, shapes=parse_assignments(shapes, "--shape"), target=target, out_dir=out_dir,
                      warmup=warmup, repeat=repeat, limit=limit)
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        from .report.tables import print_tune
        print_tune(result)


if __name__ == "__main__":  # pragma: no cover
    main()
