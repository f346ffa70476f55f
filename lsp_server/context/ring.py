"""A document's ring of context chunks: what goes before its prompt, in an order that changes rarely.

The engine caches the prompt's leading segments (engine/caching/prompt_plan.py), so any change to the
context recomputes everything after it, the file's own prompt included: on a 2-core CPU seconds of
prefill. So, as llama.vim's ring does, the ring changes only at a refresh (the server calls one on
events, never on a keystroke), and then only at its ends:
- chunks now too similar to the text around the cursor (the prompt has that text already) are dropped;
- the best candidates that fit the budget together are wanted; those it holds (the same lines, or
  identifier sets more than DUPLICATE alike) stay where they are, the others are appended, best last
  (nearest the cursor);
- while the ring is over its token budget the oldest chunk no longer wanted goes (then the oldest).
A refresh that finds the same best chunks changes nothing: the prompt, and the cache, stay as they are.
"""

from __future__ import annotations

from lsp_server.context.chunks import Chunk, jaccard

DUPLICATE = 0.9  # identifier Jaccard above which two chunks say the same (llama.vim: 0.9)
TOO_SIMILAR = 0.5  # ... above which a chunk repeats the text around the cursor (llama.vim: 0.5)
MAX_NEW = 4  # chunks one refresh may add


class Ring:
    def __init__(self) -> None:
        self.items: list[Chunk] = []
        self.version = 0  # bumped on every change (the server rebuilds the request's context then)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.items)

    def update(self, ranked: list[tuple[float, Chunk]], cursor_ids: frozenset[str], budget: int) -> bool:
        """Apply one refresh: ``ranked`` are the candidates, best first. True if the ring changed."""
        keep = [c for c in self.items if jaccard(c.ids, cursor_ids) <= TOO_SIMILAR and c.tokens <= budget]
        wanted: list[Chunk] = []  # the best candidates that fit the budget together (the ring's copy if it has one)
        new: list[Chunk] = []
        room = budget
        for _, c in ranked:
            if c.tokens > room or jaccard(c.ids, cursor_ids) > TOO_SIMILAR or any(_duplicate(c, x) for x in wanted):
                continue
            held = next((x for x in keep if _duplicate(c, x)), None)
            if held is None and len(new) >= MAX_NEW:
                continue
            wanted.append(held or c)
            if held is None:
                new.append(c)
            room -= c.tokens
        keep.extend(reversed(new))  # best last: nearest the file, and the last to be evicted
        wanted_ids = {id(c) for c in wanted}
        while keep and sum(c.tokens for c in keep) > budget:  # oldest first, those still wanted last
            victim = next((c for c in keep if id(c) not in wanted_ids), keep[0])
            keep.remove(victim)
        changed = [id(c) for c in keep] != [id(c) for c in self.items]
        if changed:
            self.items = keep
            self.version += 1
        return changed

    def drop_uri(self, uri: str) -> None:
        """Forget chunks of a document (not used in its own prompt anyway)."""
        kept = [c for c in self.items if c.uri != uri]
        if len(kept) != len(self.items):
            self.items = kept
            self.version += 1


def _duplicate(a: Chunk, b: Chunk) -> bool:
    if a.overlaps(b) or (a.kind == "import" and b.kind == "import" and a.uri == b.uri and a.name == b.name):
        return True
    return jaccard(a.ids, b.ids) > DUPLICATE
