"""Which remote engine to use (``--engine``): its spec, checks, FIM template and token (engine/remote.py runs it).
No torch here: the LSP process reads these."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from engine.errors import FimbleError
from engine.fim import TEMPLATES, FimTemplate, template_by_name

KINDS = ("openai", "llamacpp")
_LOOPBACK = ("localhost", "127.0.0.1", "::1")

# Model-name fragments -> FIM template, for fimble to build the prompt itself. CodeLlama is left out:
# its sentinels are SentencePiece pieces ("▁<PRE>"), not text a server's tokenizer would map back.
_NAME_TEMPLATES = (
    ("qwen2.5-coder", "qwen2.5-coder"),
    ("qwen2.5coder", "qwen2.5-coder"),
    ("qwen3-coder", "qwen2.5-coder"),
    ("starcoder", "starcoder2"),
    ("deepseek-coder", "deepseek-coder"),
    ("codestral", "codestral"),
)


@dataclass(frozen=True)
class RemoteSpec:
    """What ``fimble lsp --engine openai+URL|llamacpp+URL`` asks for."""

    kind: str  # "openai" | "llamacpp"
    url: str  # http(s)://host:port[/path], no trailing slash
    model: str | None = None  # the server's model name (openai); None: the first of GET {url}/models
    token_file: str | None = None  # Authorization: Bearer <first line>
    template: str | None = None  # FIM template name; None: from the model name, else the server's suffix
    timeout_s: float = 30.0  # connect, and the longest wait for the next bytes of an answer
    allow_remote: bool = False  # plain http to a host that is not loopback (--engine-allow-http)


def parse_engine(text: str) -> tuple[str, str]:
    """``openai+http://h:p/v1`` -> ("openai", "http://h:p/v1"); a user error for anything else."""
    kind, sep, url = text.partition("+")
    if not sep or kind not in KINDS:
        raise FimbleError(f"--engine {text!r}: expected openai+http(s)://HOST:PORT/v1 or llamacpp+http(s)://HOST:PORT")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FimbleError(f"--engine {text!r}: the URL after '{kind}+' must be http:// or https:// with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise FimbleError(f"--engine {text!r}: no query, fragment or credentials in the URL (use --engine-token-file)")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise FimbleError(f"--engine {text!r}: bad port") from None
    return kind, url.rstrip("/")


def check_spec(spec: RemoteSpec) -> None:
    """Refuse what would be unsafe or cannot work, with one line each (called before any connection)."""
    parts = urlsplit(spec.url)
    if parts.scheme == "http" and not _is_loopback(parts.hostname or "") and not spec.allow_remote:
        raise FimbleError(
            f"--engine {spec.url}: plain http to {parts.hostname}, which is not loopback, would send "
            "document text (and the token) unencrypted. Use https, or pass --engine-allow-http to mean it"
        )
    if not 0.5 <= spec.timeout_s <= 600:
        raise FimbleError("--engine-timeout must be from 0.5 to 600 seconds")
    if spec.template is not None:
        template_by_name(spec.template)  # unknown names are a user error here, not at the first request


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host.lower() in _LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def template_for_model(name: str | None) -> FimTemplate | None:
    """The FIM template a served model's name implies (None: unknown, let the server lay out the prompt)."""
    key = re.sub(r"[\s_]+", "-", (name or "").lower())
    for fragment, template in _NAME_TEMPLATES:
        if fragment in key:
            return TEMPLATES[template]
    return None


def _text_template(name: str | None, model: str | None) -> FimTemplate | None:
    """The template named (CodeLlama's in its text form), else the model name's, else None."""
    if name == "codellama":
        return FimTemplate("codellama", "<PRE>", "<SUF>", "<MID>", stop_tokens=("<EOT>",), spaced=True)
    return template_by_name(name) if name else template_for_model(model)


def read_token(path: str) -> str:
    try:
        lines = Path(path).read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise FimbleError(f"--engine-token-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not lines or not lines[0].strip() or any(c in lines[0] for c in "\r\n\0"):
        raise FimbleError(f"--engine-token-file {path}: expected the token on its first line")
    return lines[0].strip()
