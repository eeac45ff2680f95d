"""The serving processes' foreground commands: ``pdserve router`` and ``pdserve worker``, and the configs
their flags make."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from pdserve.cli.common import cluster_token, tls_config
from pdserve.cli.router_flags import ROUTER_FLAGS
from pdserve.deploy.local import cluster
from pdserve.router.config import RouterConfig
from pdserve.worker.args import WorkerArgs
from pdserve.worker.flags import WORKER_FLAGS
from pdserve.worker.flagspec import config_fields
from pdserve.worker.role import Role

# ``pdserve worker --role R`` runs ``serve(args: WorkerArgs)`` from this module.
POOL_MODULES = {
    Role.PREFILL: "pdserve.prefill_pool.app",
    Role.DECODE: "pdserve.decode_pool.app",
    Role.BOTH: "pdserve.decode_pool.app",
}


def router_config(args: argparse.Namespace) -> RouterConfig:
    from pdserve.engine.env import EngineEnv

    return RouterConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        cache_dir=args.cache_dir or EngineEnv.from_environ().cache_dir,
        cluster_token=cluster_token(args),
        tls=tls_config(args),
        **config_fields(args, ROUTER_FLAGS),
    )


def worker_args(args: argparse.Namespace, hostname: str, pid: int, cpus: int) -> WorkerArgs:
    from pdserve.engine.env import EngineEnv

    role = Role(args.role)
    return WorkerArgs(
        worker_id=args.worker_id or f"{role.value}-{hostname}-{pid}",
        model=args.model,
        threads=args.threads or cluster.default_threads(1, cpus),
        cache_dir=args.cache_dir or EngineEnv.from_environ().cache_dir,
        cluster_token=cluster_token(args),
        tls=tls_config(args),
        **config_fields(args, WORKER_FLAGS),
    )


def cmd_router(args: argparse.Namespace) -> int:
    from pdserve.router.server import ListenError
    from pdserve.router.server import main as serve_router

    try:
        config = router_config(args)
    except ValueError as e:  # a setting out of range: one line, naming it
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    try:
        serve_router(config)
    except ListenError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        # A model that does not resolve or load: one line for `up` to show, not a traceback.
        print(f"pdserve router: cannot serve model {args.model!r}: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import importlib
    import os
    import socket

    if args.cpus is not None:
        try:
            os.sched_setaffinity(0, args.cpus)
        except (AttributeError, OSError) as e:
            print(f"pdserve worker: cannot pin to cpus {args.cpus}: {e}", file=sys.stderr)
            return 2
    if args.device != "cpu":
        from pdserve.engine.device import resolve_device

        try:
            resolve_device(args.device)  # no GPU, or not that one: one line, before anything starts
        except ValueError as e:
            print(f"pdserve worker: {e}", file=sys.stderr)
            return 2
    # The cores this process may run on (taskset, a container's cpuset), not the machine's.
    cpus = len(args.cpus) if args.cpus is not None else len(os.sched_getaffinity(0)) or 1
    try:
        wargs = worker_args(args, socket.gethostname(), os.getpid(), cpus)
    except ValueError as e:  # e.g. a --host no interface of this machine carries
        print(f"pdserve worker: {e}", file=sys.stderr)
        return 2
    module_name = args.worker_module or POOL_MODULES[wargs.role]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        print(
            f"pdserve worker: the {wargs.role.value} pool ({module_name}) is not available: {e}",
            file=sys.stderr,
        )
        return 2
    import torch
    import uvloop

    # Set before the model loads: every worker shares the machine's cores with the others.
    torch.set_num_threads(wargs.threads)
    from pdserve.worker.agent import RegistrationError
    from pdserve.worker.bringup import WorkerFailed

    code = 0
    try:
        uvloop.run(module.serve(wargs))
    except (WorkerFailed, RegistrationError) as e:
        # One line: the message says it all (a refusal names the flags to match); a failed worker's
        # cause is in its log. A supervisor restarts on the exit status.
        print(f"pdserve worker: {e}", file=sys.stderr)
        code = 1
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End a worker whose serve loop is over (its servers, transfers and loops closed, its KV cache a
    memfd the kernel frees) without the interpreter's teardown: collecting torch's modules is slow, and a
    scale-down or ``down`` would wait for it after every drain."""
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
