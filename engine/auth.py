"""Who may talk to a TCP or WebSocket listener: loopback checks, bearer tokens, WS Origin.

The rules (PROTOCOL.md, "Security"): listeners bind loopback unless told otherwise; any
other address needs ``--allow-remote``; every listener requires a token, on loopback too
(any web page and any local user can reach a loopback port), unless ``--no-token`` (loopback
only) opts out for local tooling. A listener leaves its token in a file only this user can
read, one per port (``token_file_path``), removed at exit, where this machine's clients
(``fimble lsp --engine ws://...``) find it, as Jupyter's runtime files do. WebSocket
handshakes must carry an allowed ``Origin`` (none by default, so no web page can reach the
server) and a loopback ``Host`` (DNS rebinding). Tokens are compared in constant time.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import secrets
import socket
import stat
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from engine import env_settings
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


def runtime_dir() -> Path:
    """Where listeners leave their tokens for this user's clients: ``$FIMBLE_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR/fimble`` (per user, emptied at logout), else ``~/.cache/fimble/run``."""
    explicit = env_settings.read("FIMBLE_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "fimble"
    return Path.home() / ".cache" / "fimble" / "run"


def token_file_path(port: int) -> Path:
    """The token file of this machine's listener on ``port`` (one file per port: a client knows only the port)."""
    return runtime_dir() / f"port-{port}.token"


def _private_dir(path: Path) -> Path:
    """``path``, created 0700 if missing; an error if another user owns it (they could read or swap the files)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a folder of this user's")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def publish_token(port: int, token: str) -> Path:
    """Write ``token`` to ``token_file_path(port)``, mode 0600 (written under another name, then renamed: a
    client never reads half a token). OSError if the folder cannot be made or written."""
    folder = _private_dir(runtime_dir())
    path = folder / f"port-{port}.token"
    tmp = folder / f".port-{port}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        os.write(fd, (token + "\n").encode("utf-8"))
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def withdraw_token(path: Path, token: str) -> None:
    """Remove a token file at exit, unless another listener has since taken the port and written its own."""
    try:
        if path.read_text(encoding="utf-8").split("\n", 1)[0] == token:
            path.unlink()
    except (OSError, UnicodeDecodeError):
        pass


def find_token(host: str, port: int | None) -> str | None:
    """The token a listener on this machine left for ``port`` (None: none there, or ``host`` is not this machine)."""
    if port is None or not is_loopback(host):
        return None
    return port_token(port)


def port_token(port: int) -> str | None:
    """The token in ``token_file_path(port)``, if there is one; only a regular file of this user's counts."""
    path = token_file_path(port)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        first = path.read_text(encoding="utf-8").split("\n", 1)[0].strip()
    except (OSError, UnicodeDecodeError):
        return None
    return first if len(first) >= 16 else None


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


def token_choice(args: argparse.Namespace, host: str, loopback: bool) -> tuple[str | None, bool]:
    """The listener's token (None with --no-token) and whether it was generated (the listener prints it once it
    listens, as Jupyter does). Checks the token flags against each other and the address; a user error is one
    line."""
    if args.no_token:
        if not loopback:
            raise FimbleError(
                f"--no-token is for loopback addresses only: on {host} other machines could connect without one"
            )
        if args.token_file or args.require_token:
            raise FimbleError("--no-token contradicts --token-file and --require-token")
        print(
            "fimble: WARNING: no token (--no-token): every program and user of this machine can connect",
            file=sys.stderr,
            flush=True,
        )
        return None, False
    if args.token_file:
        return read_token(args.token_file), False
    return new_token(), True
