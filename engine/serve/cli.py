"""``fimble serve``: check the options, load the engine, run the daemon (engine/serve/daemon.py).

Every option is range-checked before the model loads; a bad one is one line, exit status 2
(the LSP server's command line prints FimbleError that way).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from engine.errors import FimbleError


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise FimbleError(f"--{name} must be from {low} to {high}")


def serve_options(args: argparse.Namespace):
    """The listener options from the command line (token rules as `fimble lsp --tcp/--ws`)."""
    from engine import auth
    from engine.auth import token_choice
    from engine.serve.daemon import ServeOptions

    _check_range("port", args.port, 0, 65535)
    _check_range("max-message-mb", args.max_message_mb, 1, 1024)
    _check_range("max-sessions", args.max_sessions, 1, 10_000)
    _check_range("max-active", args.max_active, 1, 1024)
    _check_range("threads", args.threads, 0, 1024)
    _check_range("kv-budget-mb", args.kv_budget_mb, 0, 1 << 20)
    if not args.model_name or len(args.model_name) > 200:
        raise FimbleError("--model-name must be 1-200 characters")
    loopback = auth.is_loopback(args.host)
    if not loopback and not args.allow_remote and not args.no_token:
        raise FimbleError(
            f"{args.host} is not a loopback address: other machines could connect. "
            "Pass --allow-remote to mean it (a token is then required)"
        )
    token, generated = token_choice(args, args.host, loopback)  # required by default, on loopback too
    if not loopback:
        print(
            f"fimble: WARNING: serving on {args.host}, which other machines can reach. Every client must "
            "present the token; traffic is not encrypted.",
            file=sys.stderr,
            flush=True,
        )
    return ServeOptions(
        host=args.host,
        port=args.port,
        token=token,
        show_token=generated,
        loopback=loopback,
        allow_origins=tuple(args.allow_origin),
        max_message=args.max_message_mb << 20,
        max_sessions=args.max_sessions,
        model_name=args.model_name,
    )


def check_port_free(host: str, port: int) -> None:
    """Raise a one-line FimbleError where ``host:port`` cannot be listened on now (taken, or not an address of
    this machine). Binds as asyncio's server does (SO_REUSEADDR, every address the host resolves to) and lets
    go at once; the daemon binds for real once the model is loaded (a port taken meanwhile is reported then)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise FimbleError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
                sock.listen(1)
            except OSError as exc:
                raise FimbleError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def engine_in_child(args: argparse.Namespace) -> bool:
    """Whether the decode loop runs in a child process (``--engine-process``; auto: on CUDA, where a round's GPU
    work is short enough that the listeners' share of one interpreter held it back; see engine_process.py)."""
    mode = getattr(args, "engine_process", "auto")
    return mode == "on" or (mode == "auto" and str(args.device).startswith("cuda"))


def run_serve(args: argparse.Namespace) -> int:
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        raise FimbleError(f"unknown log level {args.log_level!r}")
    logging.basicConfig(level=level, filename=args.log_file, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = serve_options(args)
    check_port_free(args.host, args.port)  # before the model loads: a taken port is one line at once, not after it

    from engine.serve.daemon import run_daemon
    from engine.serve.scheduler import open_serve_engine

    if getattr(args, "ray", False):  # replicas on Ray Serve; this process only fronts them (engine/ray_serve.py)
        from engine.ray_serve import open_ray_engine

        engine = open_ray_engine(args)
    else:
        common = dict(
            device=args.device,
            use_draft=not args.no_draft,
            batch=not args.no_batch,
            max_active=args.max_active,
            threads=args.threads or None,
        )
        if engine_in_child(args):
            from engine.serve.engine_process import SWITCH_INTERVAL_S, ServeEngineProcess

            sys.setswitchinterval(SWITCH_INTERVAL_S)
            # Loads and captures its graphs before it answers (progress on stderr).
            engine = ServeEngineProcess.start(args.model, args.draft, kv_budget_mb=args.kv_budget_mb, **common)
        else:
            budget = args.kv_budget_mb << 20 if args.kv_budget_mb else None
            engine = open_serve_engine(args.model, args.draft, kv_budget_bytes=budget, **common)
    announce = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if hasattr(engine, "warm_graphs"):  # CUDA: capture the batched rounds' graphs now, not on a first keystroke
        engine.warm_graphs(announce)
    try:
        return run_daemon(engine, options, announce=announce)
    except OSError as exc:  # the port is taken, the address is not ours
        raise FimbleError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
