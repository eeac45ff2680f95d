"""The ``pdserve`` command line's parser: every subcommand and its options (argparse)."""

from __future__ import annotations

import argparse

from pdserve.cli.autoscale_cmds import autoscale_arguments
from pdserve.cli.options import cluster_device_args, model_args, state_dir_arg, tls_args, token_arg
from pdserve.cli.router_flags import ROUTER_FLAGS, UP_HTTP_PORT, UP_ROUTER_FLAGS
from pdserve.deploy.local import cluster
from pdserve.router.config import DEFAULT_HOST, DEFAULT_PORT
from pdserve.worker import flags
from pdserve.worker.flagspec import add_flags, int_in, nonneg, positive, seconds


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default unless the text already says it (or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and default is not None
            and default is not False  # (a store_true flag; 0 is a default worth showing)
            and default != argparse.SUPPRESS
            and not (isinstance(default, (list, tuple)) and not default)
        ):
            text = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="Prefill/decode disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start a router and workers as local background processes")
    p.add_argument("--prefill", type=nonneg, default=1, help="prefill workers")
    p.add_argument("--decode", type=nonneg, default=1, help="decode workers")
    p.add_argument("--colocated", type=nonneg, default=0, help="workers that prefill and decode (role both)")
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(
            f"--{pool}-tp",
            type=positive,
            default=1,
            help=f"split each {pool} worker's model over this many processes (the worker's "
            "--tensor-parallel-size; CPU only; the pools' sizes may differ) (default %(default)s)",
        )
    model_args(p)
    add_flags(p, (flags.DTYPE, flags.QUANTIZATION))
    cluster_device_args(p, "up")
    p.add_argument("--host", default=DEFAULT_HOST, help="the address every process binds to")
    p.add_argument("--port", type=int_in(1, 65535), default=DEFAULT_PORT, help="the router's gRPC port")
    p.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="torch threads per worker (default: cores / workers, at least 1)",
    )
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="pin every worker to its own cores (its --threads of them, least used first), so that "
        "cluster shapes with the same worker count run on the same cores",
    )
    p.add_argument(
        "--timeout", type=seconds(True), default=600.0, help="seconds to wait for everything to be ready"
    )
    p.add_argument(
        "--prometheus", action="store_true", help="also start a Prometheus server scraping the cluster"
    )
    p.add_argument(
        "--prometheus-port", type=int_in(1, 65535), default=9090, help="its HTTP port (default %(default)s)"
    )
    p.add_argument(
        "--scrape-interval", type=seconds(True), default=5.0, help="its scrape interval in seconds"
    )
    p.add_argument(
        "--alertmanager",
        action="store_true",
        help="also start an Alertmanager that the Prometheus sends its alerts to (implies --prometheus)",
    )
    p.add_argument(
        "--alertmanager-port",
        type=int_in(1, 65535),
        default=9093,
        help="its HTTP port (default %(default)s)",
    )
    p.add_argument(
        "--alert-for",
        type=seconds(False),
        default=None,
        help="seconds every alert must hold before it fires, instead of each rule's own (minutes): "
        "for a demo or a test",
    )
    add_flags(p, UP_ROUTER_FLAGS)
    p.add_argument(
        "--routers",
        type=int_in(1, 16),
        default=1,
        help="routers to start (default 1): router i serves on the first one's gRPC, HTTP and metrics "
        "ports + i; every worker registers with every router, and clients may use any of them",
    )
    http = p.add_mutually_exclusive_group()
    add_flags(http, (UP_HTTP_PORT,))
    http.add_argument(
        "--no-http",
        dest=UP_HTTP_PORT.name,
        action="store_const",
        const=None,
        help="serve no HTTP API, gRPC only",
    )
    add_flags(p, flags.TUNING)
    tls_args(p, server=True)
    state_dir_arg(p)
    autoscale_arguments(p, on_up=True)

    p = sub.add_parser("scale", help="grow or shrink the pools of the local cluster")
    p.add_argument("--prefill", type=nonneg, default=None, help="prefill workers wanted (default: unchanged)")
    p.add_argument("--decode", type=nonneg, default=None, help="decode workers wanted (default: unchanged)")
    p.add_argument(
        "--colocated", type=nonneg, default=None, help="colocated workers wanted (default: as now)"
    )
    p.add_argument(
        "--timeout",
        type=seconds(False),
        default=600.0,
        help="seconds to wait for new workers / drains (0: removed workers stop at once)",
    )
    cluster_device_args(p, "scale")
    state_dir_arg(p)

    p = sub.add_parser(
        "autoscale",
        help="size the local cluster's prefill and decode pools from their load (foreground; "
        "`up --autoscale` starts it in the background)",
    )
    p.add_argument("--metrics-port", type=nonneg, default=0, help="its /metrics port (0: any free)")
    autoscale_arguments(p, on_up=False)
    state_dir_arg(p)

    p = sub.add_parser("status", help="workers, their state and load")
    p.add_argument("--json", action="store_true", help="the whole status as JSON")
    p.add_argument("--router", default=None, help="router address (default: from the state file)")
    token_arg(p)
    tls_args(p, server=False)
    state_dir_arg(p)

    p = sub.add_parser("generate", help="stream a completion to stdout")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    unset = "(default: the engine's, as for an unset field)"
    p.add_argument(
        "--max-tokens", type=int_in(1, 2**32 - 1), default=None, help=f"tokens to generate {unset}"
    )
    p.add_argument("--temperature", type=float, default=None, help=f"0: greedy {unset}")
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass {unset}")
    p.add_argument("--seed", type=int_in(0, 2**64 - 1), default=None, help="a seed: reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per streamed message")
    p.add_argument(
        "--timeout", type=seconds(False), default=600.0, help="the request's deadline in seconds (0: none)"
    )
    p.add_argument("--router", default=None, help="router address (default: from the state file)")
    tls_args(p, server=False)
    state_dir_arg(p)

    p = sub.add_parser(
        "drain",
        help="drain one worker through the router and wait until it has left (a Kubernetes preStop hook)",
    )
    p.add_argument("--worker-id", required=True, help="the id the worker registered with")
    p.add_argument("--router", default=None, help="router address (default: from the state file)")
    p.add_argument("--timeout", type=seconds(False), default=300.0, help="seconds to wait for it to leave")
    token_arg(p)
    tls_args(p, server=False)
    state_dir_arg(p)

    p = sub.add_parser("down", help="stop the local cluster: drain, SIGTERM, then SIGKILL")
    p.add_argument(
        "--timeout", type=seconds(False), default=60.0, help="seconds workers get to drain (0: stop at once)"
    )
    state_dir_arg(p)

    p = sub.add_parser("router", help="run the router in the foreground")
    p.add_argument("--host", default=DEFAULT_HOST, help="the address to bind")
    p.add_argument("--port", type=int_in(0, 65535), default=DEFAULT_PORT, help="the gRPC port (0: any)")
    model_args(p)
    add_flags(p, ROUTER_FLAGS)
    token_arg(p)
    tls_args(p, server=True)

    p = sub.add_parser("worker", help="run a worker in the foreground")
    add_flags(p, flags.IDENTITY)
    model_args(p)
    add_flags(p, flags.ENGINE)
    p.add_argument(
        "--cpus",
        type=cluster.parse_cpu_list,
        default=None,
        help="pin the worker to these cores, e.g. 0 or 0,2-3 (default: not pinned)",
    )
    add_flags(p, flags.PROCESS)
    add_flags(p, flags.TUNING)
    token_arg(p)
    tls_args(p, server=True)

    p = sub.add_parser("bench", help="load-test a running router (workloads, arrivals, goodput under SLOs)")
    # bench adds its own --router / --state-dir.
    from pdserve.bench.serve import add_arguments as bench_arguments

    bench_arguments(p)
    from pdserve.bench import sweep

    modes = p.add_subparsers(dest="bench_mode", metavar="{sweep,compare,soak}", required=False)
    q = modes.add_parser(
        "sweep",
        help="bring up one cluster shape, sweep request rates, find its goodput",
        description="Bring up a cluster shape (e.g. 1P+1D or 2C), sweep request rates and find its goodput: "
        "the highest rate at which --attainment of the requests meet both the TTFT and TPOT SLOs.",
    )
    sweep.add_arguments(q, compare=False)
    q = modes.add_parser(
        "compare",
        help="goodput of two shapes with the same worker count, on the same request stream, in one run",
        description="Bring up every shape, sweep the same request stream over all of them (alternating), "
        "and write the goodput ratio (first / second shape), SLO-attainment curves and TTFT/ITL CDF plots.",
    )
    sweep.add_arguments(q, compare=True)
    from pdserve.bench import soak

    q = modes.add_parser(
        "soak",
        help="mixed traffic for N minutes with a worker SIGKILLed a minute: lost requests, leaks, RSS",
        description="Run mixed traffic (gRPC and OpenAI streams, cancels) against a local cluster, SIGKILL "
        "one worker a minute and scale its pool back, then report requests completed/lost/refused, "
        "migrations, KV blocks leaked and each process's RSS over time (soak.json, soak_rss.png).",
    )
    soak.add_arguments(q)
    return parser


def options_follow_the_mode(parser: argparse.ArgumentParser, argv: list[str], mode: str) -> None:
    """``bench --num-prompts 4 sweep ...``: argparse lets the mode's own defaults overwrite what was given
    before the mode word, silently (a goodput SLO, the state dir of a cluster to attach to). Refused."""
    start, end = argv.index("bench") + 1, argv.index(mode)
    before = [a for a in argv[start:end] if a.startswith("-")]
    if before:
        parser.error(
            f"{' '.join(before)} before `{mode}`: the options of `pdserve bench {mode}` go after it "
            f"(pdserve bench {mode} {' '.join(argv[start:end])} ...)"
        )
