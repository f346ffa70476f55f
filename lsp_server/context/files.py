"""Reading a file of the workspace from disk: only inside the folders the client sent, size-capped,
never through a symbolic link that leads out of them.

The path is resolved (``realpath``) and must lie inside a workspace folder's resolved path; then it is
opened component by component from that folder with ``O_NOFOLLOW``, so a link swapped in after the
check fails the open instead of being followed. Only regular files, at most ``max_bytes``; a FIFO or
device is refused without blocking (``O_NONBLOCK``). Blocking calls: run it in a worker thread.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import unquote, urlparse

MAX_FILE_BYTES = 256 * 1024


def uri_to_path(uri: str) -> str | None:
    """The local path of a ``file:`` URI (None for any other scheme or a remote host)."""
    try:
        parsed = urlparse(uri)
    except ValueError:
        return None
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        return None
    path = unquote(parsed.path)
    return path if path.startswith("/") and "\x00" not in path else None


def resolve_roots(paths: list[str]) -> list[str]:
    """Workspace folders as resolved directory paths (missing ones dropped)."""
    roots = []
    for p in paths:
        try:
            real = os.path.realpath(p)
        except (OSError, ValueError):
            continue
        if os.path.isdir(real) and real not in roots:
            roots.append(real)
    return roots


def inside(roots: list[str], path: str) -> tuple[str, str] | None:
    """(root, path relative to it) where ``path``, resolved, is inside one of ``roots``; else None."""
    try:
        real = os.path.realpath(path)
    except (OSError, ValueError):
        return None
    for root in roots:
        if real.startswith(root.rstrip(os.sep) + os.sep):
            return root, os.path.relpath(real, root)
    return None


def read_inside(roots: list[str], path: str, max_bytes: int = MAX_FILE_BYTES) -> str | None:
    """The text of ``path`` if it is a regular file of at most ``max_bytes`` inside ``roots``; else None."""
    found = inside(roots, path)
    if found is None:
        return None
    root, rel = found
    parts = rel.split(os.sep)
    if any(p in ("", ".", "..") for p in parts):
        return None
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(root, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, flags | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        ffd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:  # missing, a link (ELOOP), not a directory: not read
        os.close(fd)
        return None
    os.close(fd)
    try:
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        data = b""
        while len(data) <= max_bytes:
            more = os.read(ffd, max_bytes + 1 - len(data))
            if not more:
                break
            data += more
    except OSError:
        return None
    finally:
        os.close(ffd)
    if len(data) > max_bytes or b"\x00" in data:  # grew meanwhile, or binary
        return None
    return data.decode("utf-8", errors="replace")
