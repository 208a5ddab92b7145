"""`pyinfinity bench io [DIR]` (plain `bench` means `bench io`) and `bench train` (pyinfinity vs DeepSpeed
ZeRO-3 vs PyTorch training steps; `pyinfinity bench train --help` lists its options)."""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


class _AnyWord(dict):
    """Subcommand table that lets argparse's choice check pass any word (see _DefaultToIo)."""

    def __contains__(self, key: object) -> bool:
        return True


class _DefaultToIo(argparse._SubParsersAction):
    """A first word that is not a bench subcommand is the DIR of `bench io`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choices = _AnyWord()  # the real table stays in self._name_parser_map

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        if values and values[0] not in self._name_parser_map:
            values = ["io", *values]
        super().__call__(parser, namespace, values, option_string)


def comma_list(conv: Callable[[str], Any]) -> Callable[[str], list]:
    """An argparse ``type`` for a comma-separated list, each item converted by ``conv``."""
    def parse(text: str) -> list:
        return [conv(x) for x in text.split(",") if x.strip()]

    return parse


def size_arg(text: str) -> int:
    """An argparse ``type`` for a size (4096, 256K, 1M, 1G)."""
    from pyinfinity.bench.workload import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 256K, 1M, 1G)")


def add_io_options(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """The options of `bench io`. ``suppress``: no defaults (for the `io` subparser, so options
    given before the subcommand word are not overwritten)."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--quick", action="store_true", default=d(False),
                   help="small preset, finishes in < 30 s (64 MiB file, bs 1M, qd 1/32, 3 reps)")
    p.add_argument("--file-size", type=size_arg, default=d(None), help="bytes per file (default 1G; quick 64M)")
    p.add_argument("--block-sizes", type=comma_list(size_arg), default=d(None), metavar="LIST",
                   help="e.g. 256K,1M,4M")
    p.add_argument("--queue-depths", type=comma_list(int), default=d(None), metavar="LIST", help="e.g. 1,8,32,128")
    p.add_argument("--threads", type=comma_list(int), default=d(None), metavar="LIST", help="I/O threads, e.g. 1,2")
    p.add_argument("--io-sizes", type=comma_list(size_arg), default=d(None), metavar="LIST",
                   help="bytes per request handed to the engine, e.g. 64M,1G")
    p.add_argument("--reps", type=int, default=d(None), help="repetitions per configuration (median, min, max)")
    p.add_argument("--backends", type=comma_list(str), default=d(None), metavar="LIST",
                   help="pyinfinity backends: aio,uring,posix and AioHandle (the DeepSpeed-API "
                        "handle); default: all that work on DIR")
    p.add_argument("--peers", type=comma_list(str), default=d(None), metavar="LIST",
                   help="comparison tools: fio,dd,deepspeed (default all; 'none' for none)")
    p.add_argument("--fio-engines", type=comma_list(str), default=d(None), metavar="LIST",
                   help="fio ioengines (default libaio,io_uring; quick libaio)")
    p.add_argument("--small", type=str, default=d(None), metavar="NxSIZE",
                   help="many-small-tensors workload, e.g. 4096x256K (0 to skip)")
    p.add_argument("--small-queue-depths", type=comma_list(int), default=d(None), metavar="LIST")
    p.add_argument("--no-odd", action="store_true", default=d(False), help="skip the odd-size tensors")
    p.add_argument("--no-gpu", action="store_true", default=d(False), help="skip host<->GPU and NVMe<->GPU")
    p.add_argument("--gpu-only", action="store_true", default=d(False),
                   help="only host<->GPU and NVMe<->GPU (no file sweep, no peers)")
    p.add_argument("--gpu-bytes", type=size_arg, default=d(None), help="bytes per GPU transfer (default 1G)")
    p.add_argument("--deepspeed-build", action="store_true", default=d(False),
                   help="let DeepSpeed JIT-compile its async_io op if it is not built (minutes)")
    p.add_argument("--json", metavar="FILE", default=d(None), help="write every sample + machine info")
    p.add_argument("--plot", metavar="FILE.png", default=d(None), help="GB/s vs block size (matplotlib)")
    p.add_argument("--markdown", metavar="FILE.md", default=d(None),
                   help="also write the table as Markdown (for BENCHMARKS.md)")
    p.add_argument("--keep-file", action="store_true", default=d(False), help="keep the benchmark file")
    p.add_argument("--no-progress", action="store_true", default=d(False), help="no progress bar")
    p.add_argument("--config", metavar="FILE", default=d(None),
                   help="measure the first nvme_path of this DeepSpeed-format config (instead of DIR)")


SWEEP_HELP = ("Full sweep (no --quick): 1 GiB file, block 256K/1M/4M x queue depth 1/8/32/128 x "
              "threads 1/2, one request per file (--io-sizes adds smaller ones), 3 repetitions, "
              "4096x256K small tensors and as many odd-size ones, GPU copies and stager when a GPU "
              "is present: about 15 minutes at 2 GB/s. GB/s = 1e9 bytes/s.")


def add_parser(subparsers: Any, summary: str) -> None:
    p = subparsers.add_parser("bench", help=summary,
                              description=__doc__, epilog=SWEEP_HELP)
    add_io_options(p)
    p.set_defaults(func=run_io, dir=None)
    sub = p.add_subparsers(dest="bench_command", metavar="{io,train}", action=_DefaultToIo)
    io = sub.add_parser("io", help="NVMe/file and GPU transfer GB/s per backend, with fio/dd/DeepSpeed",
                        description="Read/write GB/s of each pyinfinity backend over a sweep, side by "
                                    "side with fio, dd and DeepSpeed's aio handle on the same file.",
                        epilog=SWEEP_HELP)
    io.add_argument("dir", nargs="?", default=None,
                    help="directory to measure (default: a temp dir under $PYINFINITY_SWAP_DIR or /tmp)")
    add_io_options(io, suppress=True)
    io.set_defaults(func=run_io)
    train = sub.add_parser("train", help="training throughput: pyinfinity vs DeepSpeed ZeRO-3 vs PyTorch, "
                                              "with the analytic bound", add_help=False)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from pyinfinity.cli import bench_train

    return int(bench_train.main(args.rest) or 0)


def settings_from_args(args: argparse.Namespace, directory: str) -> "Any":
    from pyinfinity.bench.io import IoBenchSettings, quick_settings

    s = quick_settings(directory) if args.quick else IoBenchSettings(directory=directory)
    for name, attr in (("file_size", "file_size"), ("block_sizes", "block_sizes"),
                       ("queue_depths", "queue_depths"), ("threads", "threads"),
                       ("io_sizes", "io_sizes"), ("reps", "reps"), ("backends", "backends"),
                       ("fio_engines", "fio_engines"), ("gpu_bytes", "gpu_bytes"),
                       ("small_queue_depths", "small_queue_depths")):
        v = getattr(args, name, None)
        if v is not None:
            setattr(s, attr, v)
    if args.file_size is not None and args.io_sizes is None:
        s.io_sizes = [s.file_size]
    if args.peers is not None:
        s.peers = [] if args.peers == ["none"] else args.peers
        unknown = set(s.peers) - {"fio", "dd", "deepspeed"}
        if unknown:
            raise SystemExit(f"--peers: unknown {sorted(unknown)} (choose from fio, dd, deepspeed, none)")
    if args.small is not None:
        from pyinfinity.bench.workload import parse_size

        if args.small.strip() == "0":
            s.small_count = 0
        else:
            n, _, size = args.small.lower().partition("x")
            s.small_count, s.small_size = int(n), parse_size(size)
    s.odd_sizes = not args.no_odd
    s.gpu = not args.no_gpu
    s.disk = not args.gpu_only
    if args.gpu_only and args.no_gpu:
        raise SystemExit("--gpu-only and --no-gpu exclude each other")
    s.deepspeed_build = args.deepspeed_build
    s.keep_file = args.keep_file
    if s.reps < 1:
        raise SystemExit("--reps: must be >= 1")
    return s


class Progress:
    """tqdm bar on stderr, fed by the library's progress callback."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty() or enabled == "force"
        self.bar: Optional[Any] = None

    def __call__(self, done: int, total: int, desc: str) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None or self.bar.total != total:
            self.close()
            self.bar = tqdm(total=total, unit="run", file=sys.stderr, leave=False)
        self.bar.set_description(desc[:40])
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_io(args: argparse.Namespace) -> int:
    from pyinfinity.bench import table
    from pyinfinity.bench.io import run_io_bench
    from pyinfinity.bench.report import default_swap_dir

    made: Optional[str] = None
    directory = args.dir
    if directory is None and getattr(args, "config", None):
        from pyinfinity.bench.report import swap_dirs_from_config

        try:
            dirs = swap_dirs_from_config(args.config)
        except (OSError, ValueError) as exc:
            print(f"pyinfinity bench io: --config {args.config}: {exc}", file=sys.stderr)
            return 2
        if not dirs:
            print(f"pyinfinity bench io: --config {args.config} names no nvme_path", file=sys.stderr)
            return 2
        directory = dirs[0]
    if directory is None:
        base = default_swap_dir()
        made = directory = tempfile.mkdtemp(prefix="pyinfinity-bench-", dir=base)
    s = settings_from_args(args, directory)
    bar = Progress(not args.no_progress)
    try:
        run = run_io_bench(s, progress=bar, argv=["pyinfinity", *sys.argv[1:]])
    except OSError as exc:
        bar.close()
        from pyinfinity.cli.errors import one_line

        print(f"pyinfinity bench io: error: cannot benchmark {directory}: {one_line(exc)} "
              f"(`pyinfinity report --path {directory}` says what is wrong and how to fix it)", file=sys.stderr)
        return 2
    finally:
        bar.close()
        if made:
            shutil.rmtree(made, ignore_errors=True)
    m = run.machine
    fs = m.fs
    print(f"pyinfinity bench io: {directory} on {fs['mount_point']} ({fs['fs_type']}, {fs['source']}); "
          f"page cache: {run.cache}; {run.seconds:.1f} s; load average {run.load_avg[0]:.1f} -> "
          f"{run.load_avg[1]:.1f}")
    print(f"machine: {m.cpu}, {m.cores} cores, {m.ram_bytes / 2**30:.0f} GiB RAM, kernel {m.kernel}, "
          f"torch {m.torch}, GPUs: {', '.join(g['name'] for g in m.gpus) or 'none'}")
    print("backends: " + ", ".join(f"{b} ({why})" for b, why in run.backends.items()))
    print("peers: " + "; ".join(f"{p.name} {p.version}" if p.available else f"{p.name} MISSING: {p.note}"
                                for p in run.peers))
    print("GB/s = 1e9 bytes/s; median of %d repetitions, min-max beside it" % s.reps)
    print()
    print(table.results_table(run.results))
    for title, lines in (("not measured", table.skipped_lines(run.results)),
                         ("pyinfinity vs best peer", table.summary_lines(run.results)),
                         ("problems", table.failed_lines(run.results))):
        if lines:
            print(f"\n{title}:")
            for line in lines:
                print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run.to_json(), f, indent=1)
        print(f"\njson: {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"Machine: {m.cpu}, {m.cores} cores, {m.ram_bytes / 2**30:.0f} GiB RAM, kernel "
                    f"{m.kernel}, GPUs: {', '.join(g['name'] for g in m.gpus) or 'none'}; "
                    f"{directory} on {fs['fs_type']} ({fs['source']}); page cache: {run.cache}; "
                    f"pyinfinity {m.pyinfinity} ({m.source or 'no git revision'}), torch {m.torch}; "
                    f"{m.date_utc}; load average {run.load_avg[0]:.1f} -> {run.load_avg[1]:.1f}"
                    f"\n\nCommand: `{' '.join(run.argv)}`\n\n")
            f.write("Median GB/s (1e9 B/s) per tool, side by side:\n\n")
            f.write(table.pivot(run.results, markdown=True) + "\n\nEvery sample's median, min-max "
                    "and ratios:\n\n")
            f.write(table.results_table(run.results, markdown=True) + "\n")
            for line in table.summary_lines(run.results):
                f.write(f"\n- {line}")
            f.write("\n")
        print(f"markdown: {args.markdown}")
    if args.plot:
        from pyinfinity.bench.plot import plot_results

        try:
            plot_results(run.results, args.plot, title=f"{directory} ({fs['fs_type']}), {m.date_utc}")
            print(f"plot: {args.plot}")
        except ImportError:
            print("plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
            return 1
    return 1 if any(r.verified is False for r in run.results) else 0
