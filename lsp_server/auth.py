"""Who may talk to a TCP or WebSocket listener: loopback checks, bearer tokens, WS Origin.

The rules (PROTOCOL.md, "Security"): listeners bind loopback unless told otherwise; any
other address needs ``--allow-remote`` and always a token; WebSocket handshakes must carry
an allowed ``Origin`` (none by default, so no web page can reach the server) and a loopback
``Host`` (DNS rebinding). Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from engine.errors import FimbleError

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True if every address ``host`` names is a loopback one (an unresolvable name is not)."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def read_token(path: str) -> str:
    """The token in a file (its first line); a user error if it is missing or empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise FimbleError(f"--token-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not token or len(token[0].strip()) < 16:
        raise FimbleError(f"--token-file {path}: needs a token of at least 16 characters on its first line")
    return token[0].strip()


def token_matches(expected: str, given: object) -> bool:
    """Constant-time comparison (a wrong guess takes as long wherever it differs)."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8", "surrogatepass"))


def bearer(headers: object) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if any."""
    value = getattr(headers, "get", lambda _k: None)("Authorization")
    if isinstance(value, str) and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def query_token(path: str) -> str | None:
    values = parse_qs(urlsplit(path).query).get("token")
    return values[0] if values else None


def loopback_host_header(value: str | None) -> bool:
    """A ``Host`` header naming this machine's loopback (a rebound DNS name does not)."""
    if not value:
        return True  # HTTP/1.0-style clients; browsers always send one
    host = value.rsplit(":", 1)[0] if not value.endswith("]") else value
    host = host.strip("[]")
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
