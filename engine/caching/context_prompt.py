"""Cross-file context at the head of the prompt: other files' chunks, in the model's repository format.

The language server (its cross-file context service) sends a request's context as plain data::

    {"repo": "name", "path": "the/file/being/edited.py", "comment": "#", "budget": 512,
     "chunks": [{"path": "pkg/util.py", "text": "def helper(a, b):\\n    ..."}, ...]}

and the prompt builder puts it *before* the file's own FIM prompt, so it is the prompt's leading segments
(engine/caching/prompt_plan.py): the same chunks in the same order give the same tokens on every keystroke,
and the KV cache keeps them (kv_store.py also lends them to the session's other documents).

Formats, picked from the tokenizer's vocabulary:
- Qwen2.5-Coder's repository format (its report, section 3.2.2): ``<|repo_name|>name\\n<|file_sep|>path\\n
  chunk ... <|file_sep|>current path\\n`` then ``<|fim_prefix|>...``;
- StarCoder2's: ``<repo_name>name<file_sep>path\\nchunk ... <file_sep>current path\\n`` then the FIM part;
- otherwise a comment header per chunk (``# path`` then the chunk, DeepSeek-Coder's repository layout),
  plain text before the first sentinel. Models never trained on either may do worse with it: the
  language server's benchmark (bench/crossfile.py) says per model.

Budget: chunks are taken in order while their tokens fit ``budget``; the first that does not fit ends the
context (never a later one instead: what is taken stays the same when the ring appends). A context of no
chunk adds nothing, not even the header, so the prompt is then exactly the file-only one.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHUNKS = 64
MAX_CHUNK_CHARS = 16_000
MAX_CONTEXT_CHARS = 96_000  # all chunks together: a bound for any client of the wire format (fimble serve too)
MAX_BUDGET = 4096  # tokens
MAX_NAME_CHARS = 512  # repo, paths, comment


@dataclass(frozen=True)
class RepoFormat:
    name: str
    repo_token: str | None  # None: comment headers
    file_token: str | None
    repo_newline: bool = True  # Qwen: "<|repo_name|>name\n"; StarCoder2: "<repo_name>name<file_sep>"


QWEN = RepoFormat("qwen2.5-coder", "<|repo_name|>", "<|file_sep|>")
STARCODER2 = RepoFormat("starcoder2", "<repo_name>", "<file_sep>", repo_newline=False)
COMMENT = RepoFormat("comment", None, None)


def repo_format(has_token) -> RepoFormat:
    """The model's format: ``has_token(text)`` says whether the vocabulary holds that control token."""
    for fmt in (QWEN, STARCODER2):
        if has_token(fmt.repo_token) and has_token(fmt.file_token):
            return fmt
    return COMMENT


@dataclass(frozen=True)
class Context:
    repo: str
    path: str
    comment: str
    budget: int
    chunks: tuple[tuple[str, str], ...]  # (path, text)


def _text(value, limit: int, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"context {what} must be a string")
    if len(value) > limit:
        raise ValueError(f"context {what} is over {limit} characters")
    return value


def context_from_wire(data) -> Context | None:
    """A request's ``context`` checked and bounded (ValueError where it is malformed), or None."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError("context must be a map")
    chunks = data.get("chunks") or []
    if not isinstance(chunks, list | tuple) or len(chunks) > MAX_CHUNKS:
        raise ValueError(f"context chunks must be a list of at most {MAX_CHUNKS}")
    budget = data.get("budget", 0)
    if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"context budget must be an integer from 0 to {MAX_BUDGET}")
    out, total = [], 0
    for c in chunks:
        if not isinstance(c, dict):
            raise ValueError("a context chunk must be a map")
        text = _text(c.get("text", ""), MAX_CHUNK_CHARS, "chunk text")
        total += len(text)
        if total > MAX_CONTEXT_CHARS:
            raise ValueError(f"context chunks are over {MAX_CONTEXT_CHARS} characters")
        out.append((_text(c.get("path", ""), MAX_NAME_CHARS, "path"), text))
    return Context(
        _text(data.get("repo", ""), MAX_NAME_CHARS, "repo"),
        _text(data.get("path", ""), MAX_NAME_CHARS, "path"),
        _text(data.get("comment", "#"), 16, "comment"),
        budget,
        tuple(out),
    )


def header_texts(fmt: RepoFormat, ctx: Context) -> list[tuple[str | None, str, str]]:
    """Per chunk, (control token or None, header text, chunk text); then the current file's own header
    (chunk text ""). Comment style has no current-file header: its text would sit before the suffix."""
    out: list[tuple[str | None, str, str]] = []
    for i, (path, text) in enumerate(ctx.chunks):
        body = text if text.endswith("\n") else text + "\n"
        if fmt.repo_token is None:
            out.append((None, f"{ctx.comment} {path}\n", body))
            continue
        if i == 0:  # the repository's name rides the first chunk's segment
            out.append((fmt.repo_token, ctx.repo + ("\n" if fmt.repo_newline else ""), ""))
        out.append((fmt.file_token, f"{path}\n", body))
    if fmt.file_token is not None and ctx.chunks:
        out.append((fmt.file_token, f"{ctx.path}\n", ""))
    return out
