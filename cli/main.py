"""The ``pdserve`` command line: parse, then dispatch to a subcommand (one line per failure, no traceback).

The environment is read in the CLI only (``engine.env.EngineEnv``: the model cache directory).
"""

from __future__ import annotations

import argparse
import logging
import sys

import grpc

from pdserve.cli import autoscale_cmds, client_cmds, cluster_cmds, lifeline, scale_cmds, serve_cmds
from pdserve.cli.common import cluster_token, say, tls_config
from pdserve.cli.parser import build_parser, options_follow_the_mode
from pdserve.deploy.local import cluster
from pdserve.router.config import RouterConfig
from pdserve.worker.tls import TLSError

COMMANDS = {
    "up": cluster_cmds.cmd_up,
    "scale": scale_cmds.cmd_scale,
    "autoscale": autoscale_cmds.cmd_autoscale,
    "status": client_cmds.cmd_status,
    "generate": client_cmds.cmd_generate,
    "drain": client_cmds.cmd_drain,
    "down": cluster_cmds.cmd_down,
    "router": serve_cmds.cmd_router,
    "worker": serve_cmds.cmd_worker,
    "bench": client_cmds.cmd_bench,
}
# Commands that run until stopped: they stop with the process PDSERVE_EXIT_WITH_PID names (cli.lifeline).
LONG_RUNNING = ("router", "worker", "autoscale")


def main(argv: list[str] | None = None) -> int:
    from pdserve.worker.auth import TokenError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "bench" and args.bench_mode:
        options_follow_the_mode(parser, argv, args.bench_mode)
    if args.command == "up":
        try:  # what the router would refuse seconds later, once everything started: here, naming the flags
            RouterConfig(
                heartbeat_interval_s=args.heartbeat_interval, heartbeat_timeout_s=args.heartbeat_timeout
            )
        except ValueError as e:
            parser.error(str(e))
    if args.command in ("router", "worker"):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in LONG_RUNNING:
        try:
            parent = lifeline.exit_with_pid()
        except ValueError as e:
            say(f"pdserve {args.command}: {e}")
            return 2
        if parent is not None:
            lifeline.start_lifeline(parent, what=f"pdserve {args.command}")
    try:
        if args.command in ("router", "worker"):
            cluster_token(args)  # a bad token file fails here, in one line, before anything starts
            tls_config(args).check_server()  # and bad TLS files
        return COMMANDS[args.command](args)
    except (TokenError, TLSError) as e:
        say(f"pdserve {args.command}: {e}")
        return 2
    except cluster.ClusterError as e:
        say(f"pdserve {args.command}: {e}")
        return 1
    except grpc.RpcError as e:
        say(f"pdserve {args.command}: {e.code().name}: {e.details()}{_tls_hint(args, e)}")
        return 1
    except OSError as e:
        if args.command in LONG_RUNNING:
            raise  # a server's own fault: its traceback, in its log
        # The state dir read-only, full or a file: one line naming the path, as the other errors.
        say(f"pdserve {args.command}: {e}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what the command started is stopped on the way out (its finally)
        say(f"pdserve {args.command}: interrupted")
        return 130


def _tls_hint(args: argparse.Namespace, err: grpc.RpcError) -> str:
    """A router given by --router that closed the connection may serve TLS (or want a client
    certificate) that the flags did not give: gRPC says only "Socket closed"."""
    if not getattr(args, "router", None) or err.code() is not grpc.StatusCode.UNAVAILABLE:
        return ""
    if getattr(args, "tls_ca", None) is None:
        return " (if the router serves TLS, give its CA with --tls-ca)"
    if getattr(args, "tls_cert", None) is None:
        return " (if the router requires client certificates, give one with --tls-cert and --tls-key)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
