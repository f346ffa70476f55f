"""``fimble`` command line: ``lsp`` (the server), ``serve`` (one engine for many editors),
and ``complete FILE:LINE:COL``. (The benchmarks are not behind it: ``python -m bench.NAME`` in a checkout.)

User errors print one line, ``fimble: <message>``, and exit with status 2: no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from engine import env_settings
from engine.errors import FimbleError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=env_settings.read("FIMBLE_MODEL"),
        help="model folder (default: $FIMBLE_MODEL, else the embedded model)",
    )
    p.add_argument("--draft", default=env_settings.read("FIMBLE_DRAFT"), help="draft model folder")
    p.add_argument("--no-draft", action="store_true", help="decode without a draft model")
    p.add_argument("--device", default="cpu")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """A non-local engine: an OpenAI-compatible or llama.cpp server (engine/remote.py)."""
    p.add_argument(
        "--engine",
        metavar="SPEC",
        help="use a running engine instead of a local model: ws://HOST:PORT (a `fimble serve` daemon), "
        "openai+http(s)://HOST:PORT/v1 "
        "(vLLM, SGLang, llama-server, Ollama, fimble serve) or llamacpp+http(s)://HOST:PORT (/infill)",
    )
    p.add_argument(
        "--remote-model", metavar="NAME", help="the server's model name (openai+: default, the first of GET /v1/models)"
    )
    p.add_argument(
        "--remote-template",
        metavar="NAME",
        help="the served model's FIM template, for fimble to lay out the prompt (default: from the "
        "model name; unknown: the server gets prompt + suffix)",
    )
    p.add_argument("--engine-token-file", metavar="PATH", help="send the token on this file's first line as a Bearer")
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the engine server to connect or send more (default 30)",
    )
    p.add_argument(
        "--engine-allow-http",
        action="store_true",
        help="allow plain http to an engine that is not on loopback (code and token travel unencrypted)",
    )


def _add_token_args(p: argparse.ArgumentParser, what: str) -> None:
    """The listener's token flags (engine/auth.py): a token is required by default, on loopback too."""
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help="clients must present the token on this file's first line (default: a new random token, "
        "printed to stderr and left in a file only you can read, named on stderr)",
    )
    p.add_argument(
        "--no-token",
        action="store_true",
        help=f"no token, for local tooling; loopback only. Then every program and every user of this "
        f"machine can connect to {what} and read what its clients send (web pages still cannot: "
        "a WebSocket needs an allowed Origin, TCP an LSP header first)",
    )
    p.add_argument("--require-token", action="store_true", help="(the default now; kept for older scripts)")


def _remote_spec(args: argparse.Namespace):
    """The --engine flags as an engine.remote.RemoteSpec (None: the local model), checked now."""
    given = [f for f in ("remote_model", "remote_template", "engine_token_file") if getattr(args, f)]
    if not args.engine:
        if given or args.engine_allow_http:
            raise FimbleError(
                "--remote-model, --remote-template, --engine-token-file and --engine-allow-http need --engine"
            )
        return None
    if args.engine.startswith(("ws://", "wss://")):  # a shared `fimble serve` daemon (engine/serve/)
        from engine.serve.client import serve_spec

        if args.remote_model or args.remote_template:
            raise FimbleError("--remote-model and --remote-template are for openai+/llamacpp+ engines, not ws://")
        return serve_spec(args.engine, args.engine_token_file, args.engine_timeout, args.engine_allow_http)
    from engine.remote import RemoteSpec, check_spec, parse_engine, read_token

    kind, url = parse_engine(args.engine)
    spec = RemoteSpec(
        kind,
        url,
        model=args.remote_model,
        token_file=args.engine_token_file,
        template=args.remote_template,
        timeout_s=args.engine_timeout,
        allow_remote=args.engine_allow_http,
    )
    check_spec(spec)
    if spec.token_file:
        read_token(spec.token_file)  # a missing or empty file is an error now, not at the first completion
    return spec


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fimble", description="Local code completion over LSP")
    ap.add_argument("--version", action="version", version="fimble 0.1.0")
    sub = ap.add_subparsers(dest="command", required=True)

    lsp = sub.add_parser("lsp", help="run the language server (stdio unless --tcp/--ws)")
    lsp.add_argument("--stdio", action="store_true", help="talk over stdin/stdout (the default)")
    lsp.add_argument(
        "--tcp", metavar="HOST:PORT", help="listen on TCP, one session per connection (host defaults to 127.0.0.1)"
    )
    lsp.add_argument("--ws", metavar="HOST:PORT", help="listen for WebSocket clients (text frames), one session each")
    lsp.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow --tcp/--ws on an address that is not loopback (other machines can then connect)",
    )
    _add_token_args(lsp, "--tcp/--ws")
    lsp.add_argument(
        "--allow-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="a browser Origin (e.g. http://localhost:3000) allowed to open a WS session; repeatable",
    )
    lsp.add_argument(
        "--max-message-mb", type=int, default=16, help="largest JSON-RPC message accepted (MiB, default 16)"
    )
    lsp.add_argument("--max-sessions", type=int, default=64, help="connections served at once (--tcp/--ws)")
    lsp.add_argument(
        "--init-timeout",
        type=float,
        default=60.0,
        help="seconds a --tcp/--ws connection may stay open without sending initialize",
    )
    lsp.add_argument(
        "--debug",
        action="store_true",
        help="log every message in full and answer fimble/debug/document (both show document text)",
    )
    lsp.add_argument("--log-level", default=env_settings.read("FIMBLE_LOG"))
    lsp.add_argument("--log-file", help="log here instead of stderr")
    _add_model_args(lsp)
    _add_engine_args(lsp)

    comp = sub.add_parser("complete", help="print a completion at FILE:LINE:COL (1-based)")
    comp.add_argument("spec", metavar="FILE:LINE:COL")
    comp.add_argument("--max-tokens", type=int, default=64, help="at most this many tokens (default 64)")
    comp.add_argument("--max-lines", type=int, default=8, help="at most this many lines (default 8)")
    comp.add_argument("--drafter", default="auto", choices=("auto", "model", "ngram", "none"))
    comp.add_argument(
        "--raw",
        action="store_true",
        help="the model's text as decoded: no syntax policy, no shaping (default: as an editor shows it)",
    )
    comp.add_argument("--stats", action="store_true", help="print decode statistics to stderr")
    _add_model_args(comp)
    comp.add_argument("--template", help="FIM template name (default: detected from the tokenizer)")
    comp.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run code shipped in the model folder (off by default)",
    )

    srv = sub.add_parser("serve", help="run one engine for many editors (websockets + OpenAI /v1/completions)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8765, help="port (0: any free one, printed at start)")
    srv.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host that is not loopback (other machines can then connect)",
    )
    _add_token_args(srv, "the daemon")
    srv.add_argument(
        "--allow-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="a browser Origin allowed to connect; repeatable (default: none)",
    )
    srv.add_argument("--max-message-mb", type=int, default=16, help="largest message accepted (MiB, 1-1024)")
    srv.add_argument("--max-sessions", type=int, default=256, help="websocket sessions at once (1-10000)")
    srv.add_argument("--max-active", type=int, default=64, help="sequences stepped together (1-1024)")
    srv.add_argument(
        "--no-batch",
        action="store_true",
        help="step sequences round-robin, one forward each, instead of one batched forward",
    )
    srv.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: batched passes then equal solo ones bit for bit; 0: torch's "
        "default; up to 1024)",
    )
    srv.add_argument("--kv-budget-mb", type=int, default=0, help="KV cache budget in MiB (0: the default)")
    srv.add_argument(
        "--engine-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the decode loop in a child process, so it and the listeners each have an "
        "interpreter (auto: on with --device cuda; engine/serve/engine_process.py)",
    )
    srv.add_argument("--model-name", default="fimble", help="the model name the OpenAI API reports")
    srv.add_argument("--log-level", default=env_settings.read("FIMBLE_LOG"))
    srv.add_argument("--log-file", help="log here instead of stderr")
    srv.add_argument(
        "--ray",
        action="store_true",
        help="run the engine as Ray Serve replicas, a document kept on one (engine/ray_serve.py; "
        "needs pip install 'fimble[ray]')",
    )
    srv.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas (1-1024, default 2)")
    srv.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="with --ray: the Ray cluster to join (e.g. auto, ray://HOST:10001; default: a local one)",
    )
    srv.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs reserved per replica")
    srv.add_argument("--replica-gpus", type=float, default=0.0, help="with --ray: GPUs per replica (use --device cuda)")
    _add_model_args(srv)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Every FIMBLE_* environment variable range-checked first (engine/env_settings.py), for every subcommand.
    errors = env_settings.check_environment()
    for message in errors:
        print(f"fimble: {message}", file=sys.stderr)
    if errors:
        return 2
    args = _parser().parse_args(argv)
    try:
        if args.command == "lsp":
            return run_lsp(args)
        if args.command == "serve":
            from engine.serve.cli import run_serve  # the daemon's options, checked there

            return run_serve(args)
        return run_complete(args)
    except FimbleError as exc:
        print(f"fimble: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# -- lsp -------------------------------------------------------------------------------------
def _quiet_pygls(record: logging.LogRecord) -> bool:
    """Without --debug, pygls' records lose their arguments (messages, params: document text) and
    INFO/DEBUG ones are dropped (pygls logs every message sent at INFO), as are its deserialisation errors."""
    if not record.name.startswith("pygls"):
        return True
    if record.levelno < logging.WARNING or record.getMessage().startswith("Cancel notification for unknown"):
        return False
    if str(record.msg).startswith("Unable to deserialize message"):  # fimble's protocol logs its own line for
        return False  # these, counted (lsp_server/protocol.py log_dropped): 2 lines each made a flood fill the log
    if record.args:
        record.msg, record.args = f"{record.msg} [arguments withheld: run with --debug]", None
    return True


def run_lsp(args: argparse.Namespace) -> int:
    from engine import auth
    from engine.auth import token_choice
    from lsp_server.framing import Limits
    from lsp_server.settings import Settings
    from lsp_server.transports import ListenOptions, parse_address, serve

    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        raise FimbleError(f"unknown log level {args.log_level!r}")
    logging.basicConfig(level=level, filename=args.log_file, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.debug:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_pygls)
    else:  # an editor cancelling a request that has just been answered is normal, not worth a warning
        logging.getLogger("pygls.protocol.json_rpc").addFilter(
            lambda record: not record.getMessage().startswith("Cancel notification for unknown message id")
        )
    if args.tcp and args.ws:
        raise FimbleError("choose one of --tcp and --ws")
    if not 1 <= args.max_message_mb <= 4096:
        raise FimbleError("--max-message-mb must be from 1 to 4096")
    if not 1 <= args.max_sessions <= 10_000:
        raise FimbleError("--max-sessions must be from 1 to 10000")
    if not 0.1 <= args.init_timeout <= 3600:
        raise FimbleError("--init-timeout must be from 0.1 to 3600 seconds")
    options = ListenOptions(
        limits=Limits(max_message=args.max_message_mb << 20),
        debug=args.debug,
        allow_origins=tuple(args.allow_origin),
        max_sessions=args.max_sessions,
        init_timeout=args.init_timeout,
    )
    address = args.tcp or args.ws
    if address:
        try:
            host, _ = parse_address(address)
        except ValueError as exc:
            raise FimbleError(str(exc)) from None
        loopback = auth.is_loopback(host)
        if not loopback and not args.allow_remote and not args.no_token:
            raise FimbleError(
                f"{host} is not a loopback address: other machines could connect. "
                "Pass --allow-remote to mean it (a token is then required)"
            )
        token, generated = token_choice(args, host, loopback)
        if not loopback:
            print(
                f"fimble: WARNING: serving on {host}, which other machines can reach. Every client must "
                "present the token (PROTOCOL.md, Security); traffic is not encrypted.",
                file=sys.stderr,
                flush=True,
            )
        options = dataclasses.replace(options, token=token, show_token=generated, loopback=loopback)
    elif args.allow_remote or args.require_token or args.token_file or args.no_token or args.allow_origin:
        raise FimbleError(
            "--allow-remote, --require-token, --token-file, --no-token and --allow-origin need --tcp or --ws"
        )
    defaults = dataclasses.replace(
        Settings(),
        model=args.model,
        draft=args.draft,
        no_draft=args.no_draft,
        device=args.device,
        engine_spec=_remote_spec(args),
    )
    return serve(defaults, tcp=args.tcp, ws=args.ws, options=options)


# -- complete --------------------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[Path, int, int]:
    """FILE:LINE:COL -> (path, line, col), both 1-based. The file name may itself contain ':'."""
    parts = spec.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise FimbleError(f"expected FILE:LINE:COL, got {spec!r}")
    try:
        line, col = int(parts[1]), int(parts[2])
    except ValueError:
        raise FimbleError(f"LINE and COL must be numbers in {spec!r}") from None
    if line < 1 or col < 1:
        raise FimbleError(f"LINE and COL are 1-based: got {line}:{col}")
    return Path(parts[0]), line, col


def read_source(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FimbleError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise FimbleError(f"{path}: is a directory") from None
    except OSError as exc:
        raise FimbleError(f"{path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FimbleError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def run_complete(args: argparse.Namespace) -> int:
    from lsp_server.documents import Document
    from lsp_server.plan import PolicySkipped, fixed_options, plan_at
    from lsp_server.prompt import build_context, clean
    from lsp_server.settings import Settings
    from lsp_server.shaping.stage import shape_whole
    from lsp_server.shaping.syntax.languages import normalize_language_id

    path, line, col = parse_spec(args.spec)
    # The language from the file name, as an editor would send it (".py" -> python): the policy needs it.
    language = normalize_language_id(path.suffix.lstrip(".")) or ""
    doc = Document(uri=path.resolve().as_uri(), text=read_source(path), language_id=language)
    if line > len(doc.lines):
        raise FimbleError(f"{path} has {len(doc.lines)} lines; line {line} is past the end")
    width = len(doc.line_text(line - 1))
    if col > width + 1:
        raise FimbleError(f"line {line} of {path} has {width} characters; column {col} is past its end")
    if not 1 <= args.max_tokens <= 4096:
        raise FimbleError("--max-tokens must be between 1 and 4096")
    if not 0 <= args.max_lines <= 1000:
        raise FimbleError("--max-lines must be between 0 (no limit) and 1000")
    s = dataclasses.replace(Settings(), max_tokens=args.max_tokens, max_lines=args.max_lines, drafter=args.drafter)
    ctx = build_context(doc, line - 1, col - 1, s.prefix_chars, s.suffix_chars)

    # Loaded only now: bad input above fails fast, without importing torch.
    from engine.api import CompletionRequest
    from engine.local import open_engine

    engine = open_engine(
        args.model,
        args.draft,
        device=args.device,
        use_draft=not args.no_draft,
        template=args.template,
        trust_remote_code=args.trust_remote_code,
        start_thread=False,
    )
    opts, shaper, where = fixed_options(s), None, "raw"
    if not args.raw:  # what the editor would show: the plan recipe of every editor request (options, shaper)
        try:
            plan = plan_at(doc, ctx.cursor, s)
            opts, shaper, where = plan.options, plan.shaper, plan.decision.context
        except PolicySkipped:  # a cursor line too long to classify: the fixed settings, unshaped (as in an editor)
            where = "skipped_long_line"
    result = engine.complete(CompletionRequest(clean(ctx.prefix), clean(ctx.suffix), options=opts, truncate=True))
    text, cut = result.text, None
    if shaper is not None:
        text, cut = shape_whole(shaper, text)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    if args.stats:
        st = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.stats.items()}
        print(
            f"fimble: {result.finish_reason}, {result.tokens} tokens, context {where}, cut {cut}, {st}", file=sys.stderr
        )
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
