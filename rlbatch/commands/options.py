"""The options layer: one spelling per option, shared by every command.

Each ``add_*`` function adds one argparse group; the matching ``*_from_args`` builds the typed
object the group describes (a :class:`DeploymentSpec`, an :class:`SLA`, ...). Commands never
define ``--gpu``, ``--model``, ``--pools``, ``--max-num-seqs`` & co. themselves, so a
deployment is named the same way everywhere (DESIGN.md, command-line contract).

Spellings: ``--gpu``, ``--model``, ``--pools fp16:1,fp8:1``, ``--tp``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--gpu-memory-utilization``, ``--max-model-len``,
``--kv-cache-mib``, ``--buckets`` (edges), ``--over-length``, ``--max-queue-len``,
``--no-event-skipping``, ``--no-prefix-caching``, ``--kv-offload-gib``,
``--sla-ttft-s``, ``--sla-tpot-s``, ``--tick-s``, ``--seed``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rlbatch.buckets import Buckets
from rlbatch.commands.argtypes import checked, non_negative_float, parse_window
from rlbatch.control.controllers import make_controller
from rlbatch.control.specs import controller_specs, with_overrides
from rlbatch.control.types import SLA
from rlbatch.engine.config import parse_pools
from rlbatch.engine.reserve import KV_RESERVE_MODES
from rlbatch.engine.vllm.config import TINY_MODEL, VllmEngineConfig
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.settings import add_flags

GPU_HELP = "GPU profile name or JSON file (a100-80g, h100-80g, h200-141g)"
MODEL_HELP = ("model profile name or JSON file (llama-2-7b, llama-3.1-8b, llama-2-70b, "
              "deepseek-v3)")


def add_gpu_model_options(group: Any, *, gpu: str | None = "a100-80g",
                          model: str | None = "llama-2-7b", required: bool = False) -> None:
    """``--gpu`` and ``--model``.

    :param group: a parser or argument group.
    :param gpu: default GPU profile (``None``: no default).
    :param model: default model profile (``None``: no default).
    :param required: ``--gpu`` is required (no default makes sense, e.g. profile-check).
    """
    group.add_argument("--gpu", default=gpu, required=required, help=GPU_HELP)
    group.add_argument("--model", default=model, help=MODEL_HELP)


def add_pools_option(group: Any, default: str = "fp16") -> None:
    """``--pools``: engines per pool, ``fp16`` or ``fp16:1,fp8:1``.

    :param group: a parser or argument group.
    :param default: the default pools text.
    """
    group.add_argument("--pools", default=parse_pools(default), type=checked(parse_pools),
                       help=f"pools and engines per pool, e.g. fp16 or fp16:1,fp8:1 (default "
                            f"{default})")


def add_buckets_option(group: Any) -> None:
    """``--buckets``: prompt-length bucket edges.

    :param group: a parser or argument group.
    """
    group.add_argument("--buckets", type=checked(Buckets.parse), default=Buckets(),
                       help="prompt-length bucket edges in tokens (default 1024,2048,4096)")


def add_sla_options(group: Any) -> None:
    """``--sla-ttft-s`` and ``--sla-tpot-s``.

    :param group: a parser or argument group.
    """
    group.add_argument("--sla-ttft-s", type=float, default=SLA().ttft_s,
                       help="TTFT limit per request (default %(default)s)")
    group.add_argument("--sla-tpot-s", type=float, default=SLA().tpot_s,
                       help="TPOT limit per request (default %(default)s)")


def sla_from_args(args: argparse.Namespace) -> SLA:
    """The SLA :func:`add_sla_options` describes.

    :param args: parsed options.
    """
    return SLA(ttft_s=args.sla_ttft_s, tpot_s=args.sla_tpot_s)


def add_over_length_option(group: Any, default: str | None = "reject",
                           default_text: str = "") -> None:
    """``--over-length reject|truncate``.

    :param group: a parser or argument group.
    :param default: the default policy (``None``: decided elsewhere, see ``default_text``).
    :param default_text: what the default means, for the help text.
    """
    meaning = default_text or (f"default {default}" if default else "default: unset")
    group.add_argument("--over-length", choices=("reject", "truncate"), default=default,
                       help=f"requests longer than max-model-len: reject (vLLM) or truncate "
                            f"the prompt ({meaning}); either way counted")


def add_deployment_options(parser: argparse.ArgumentParser) -> None:
    """The deployment group (engines, budgets, admission) and the control group (tick, SLA,
    cold start, drain) of the commands that run a deployment (evaluate, simulate).

    :param parser: the command's parser.
    """
    g = parser.add_argument_group("deployment")
    g.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="the simulator, or real in-process vLLM engines (--model tiny or a "
                        "checkpoint folder; runs in wall-clock time)")
    g.add_argument("--profile", default=None,
                   help="calibrated step-time profile for the simulator (rlbatch calibrate)")
    add_gpu_model_options(g)
    add_pools_option(g)
    g.add_argument("--tp", type=int, default=None, help="tensor parallel degree "
                   "(default: the model profile's)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine max_num_seqs (default: vLLM's default for the GPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine token budget per iteration (default: vLLM's for the GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt+output accepted (default: the model's context)")
    add_over_length_option(g)
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="per-bucket admission queue bound (default unbounded)")
    add_flags(g, AdmissionConfig, only=("queue_ttl_s", "reject_ttft_slack",
                                        "max_num_queued_tokens", "max_retry_after_s",
                                        "retry_overload", "deadline_prefill"))
    g.add_argument("--clients", default="patient", metavar="MIX",
                   help="the clients behind the arrivals: patient (wait forever, never "
                        "retry), sdk (the openai client's defaults: 600-s timeout, 2 "
                        "retries on 408/409/429/5xx and timeouts, Retry-After honoured up "
                        "to 120 s, else backoff 0.5-8 s with jitter), interactive (gives up "
                        "without a first token after 20 s, no retry), or a mix such as "
                        "interactive:0.3,sdk:0.7; a client that gives up cancels its "
                        "request (rlbatch/serving/clients.py)")
    add_buckets_option(g)
    g.add_argument("--no-event-skipping", action="store_true",
                   help="step every iteration (same results, slower; for checking)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="simulated engines without vLLM's prefix caching (on by default, as "
                        "in vLLM V1; only requests with prefix ids, e.g. Mooncake's, can "
                        "hit)")
    g.add_argument("--kv-offload-gib", type=non_negative_float, default=0.0, metavar="GIB",
                   help="host-memory KV tier of each simulated engine, GiB (vLLM's "
                        "--kv-offloading-size, native CPU backend): computed prompt blocks "
                        "are copied to host memory and a prefix evicted from the GPU is "
                        "loaded back over the GPU profile's host link; 0 = off (default)")
    s = parser.add_argument_group("control and SLA")
    s.add_argument("--cold-start", action="store_true",
                   help="runs start right after an engine start: the guard's warm-up ramp "
                        "applies (simulated engines are otherwise warm from t=0)")
    s.add_argument("--tick-s", type=float, default=1.0, help="control interval (engine s)")
    s.add_argument("--kv-reserve", choices=KV_RESERVE_MODES, default="observed",
                   help="how the guard's KV budget counts a request: observed (a high "
                        "quantile of its bucket's recent outputs, grown while it runs; the "
                        "default), declared (its max_tokens, or the rest of the context when "
                        "it sends none) or oracle (its real output length: an upper bound "
                        "only a trace replay can know)")
    s.add_argument("--kv-reserve-quantile", type=float, default=0.9,
                   help="output quantile the observed reserve takes (default 0.9)")
    s.add_argument("--kv-reserve-shift", action=argparse.BooleanOptionalAction, default=True,
                   help="the observed reserve forgets a bucket's older outputs when its "
                        "recent completions turn longer (6 of the last 16 past its quantile)")
    add_sla_options(s)
    s.add_argument("--drain-s", type=float, default=600.0,
                   help="how long after the last arrival a run may go on; what is left "
                        "counts as unfinished")


def deployment_spec_from_args(args: argparse.Namespace) -> DeploymentSpec:
    """The :class:`DeploymentSpec` :func:`add_deployment_options` describes.

    :param args: parsed options.
    """
    return DeploymentSpec(
        gpu=args.gpu, model=args.model, pools=args.pools, tp=args.tp,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        buckets=args.buckets,
        admission=AdmissionConfig(over_length=args.over_length,
                                  max_queue_len=args.max_queue_len,
                                  queue_ttl_s=args.queue_ttl_s,
                                  reject_ttft_slack=args.reject_ttft_slack,
                                  max_num_queued_tokens=args.max_num_queued_tokens,
                                  max_retry_after_s=args.max_retry_after_s,
                                  retry_overload=args.retry_overload,
                                  deadline_prefill=args.deadline_prefill),
        clients=args.clients, clients_seed=getattr(args, "seed", 0),
        event_skipping=not args.no_event_skipping,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_offload_gib=args.kv_offload_gib,
        sla=sla_from_args(args), tick_s=args.tick_s,
        cold_start=args.cold_start, engine=args.engine, profile=args.profile,
        kv_reserve=args.kv_reserve, kv_reserve_quantile=args.kv_reserve_quantile,
        kv_reserve_shift=args.kv_reserve_shift)


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """``--window``, ``--max-requests``, ``--seed``: which part of a trace, and the seed of
    generators and jitter.

    :param parser: the command's parser.
    """
    w = parser.add_argument_group("workload")
    w.add_argument("--window", type=parse_window, default=None, metavar="START:END",
                   help="use only arrivals in [START, END) seconds of the trace")
    w.add_argument("--max-requests", type=int, default=None, help="first N requests only")
    w.add_argument("--seed", type=int, default=0, help="seed for generators and jitter")
    w.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="clients declare max_tokens=N (or the real output, if longer): the "
                        "ceiling of the guard's KV count (--kv-reserve); default: none "
                        "declared (traces carry only the real output)")


# controllers


CONTROLLER_HELP = ("a preset (static:N, vllm-default, playbook, aimd, random, fixed:N, mpc, "
                   "ppo:PATH), the same with settings in brackets "
                   "(fixed:256[order=deadline], ppo:PATH[release=none]) or a settings file "
                   "(.toml)")


def add_settings_option(group: Any) -> None:
    """``--set KEY=VALUE``: settings added to every controller given (:mod:`rlbatch.control.
    specs`).

    :param group: a parser or argument group.
    """
    group.add_argument("--set", dest="settings", action="append", default=[],
                       metavar="KEY=VALUE",
                       help="a setting of every controller given, e.g. --set order=deadline, "
                            "--set guard.p99=false, --set release.wait_fraction=0.25 (the "
                            "keys are the fields of each controller's settings; repeat for "
                            "more)")


def controllers_from_args(text: str, overrides: Sequence[str]) -> list[str]:
    """The controller specs a list and ``--set`` ask for, each built once so that a bad name
    or setting fails before any run.

    :param text: a comma-separated list (``static:{8,16}`` expands).
    :param overrides: ``--set`` texts.
    :raises ValueError: a bad name or setting (naming it).
    """
    specs = [with_overrides(s, overrides) for s in controller_specs(text)]
    for spec in specs:
        make_controller(spec)
    return specs


# live engine


def add_live_engine_options(parser: argparse.ArgumentParser) -> None:
    """The live vLLM engine group of ``calibrate`` and ``fidelity``: ``--engine``,
    ``--model``, ``--pools``, ``--dtype``, ``--max-model-len``, ``--max-num-seqs``,
    ``--max-num-batched-tokens``, ``--kv-cache-mib``, ``--gpu-memory-utilization``,
    ``--num-kv-blocks``, ``--block-size``, ``--seed``.

    :param parser: the command's parser.
    """
    g = parser.add_argument_group("live engine")
    g.add_argument("--engine", choices=("vllm",), default="vllm",
                   help="engine to measure (vllm: a vLLM LLMEngine in this process)")
    g.add_argument("--model", default=TINY_MODEL,
                   help="checkpoint folder or hub id; 'tiny' builds a tiny random Llama "
                        "(default)")
    add_pools_option(g)
    g.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt+output (default 2048)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="engine max_num_seqs (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="engine token budget per iteration (default 2048)")
    g.add_argument("--kv-cache-mib", type=int, default=64,
                   help="KV pool size in MiB (vLLM kv_cache_memory_bytes; 0 = let vLLM size "
                        "it from --gpu-memory-utilization, GPU only)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="force the KV block count (vLLM num_gpu_blocks_override)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: vLLM's, 16 on CUDA / 128 on CPU; "
                        "CPU needs a multiple of 32)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (and workload seed)")


def live_engine_config_from_args(args: argparse.Namespace) -> VllmEngineConfig:
    """The :class:`VllmEngineConfig` :func:`add_live_engine_options` describes (the pools'
    KV cache dtype is set per pool when the engines start).

    :param args: parsed options.
    """
    mib = args.kv_cache_mib
    return VllmEngineConfig(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=mib * 2**20 if mib else None,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, seed=args.seed)
