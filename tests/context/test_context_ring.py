"""The ring of context chunks (lsp_server/context/ring.py): stable order, best last, dedupe, eviction."""

from __future__ import annotations

from lsp_server.context.chunks import Chunk, identifiers
from lsp_server.context.ring import MAX_NEW, Ring


def chunk(uri: str, start: int, text: str, kind: str = "tab") -> Chunk:
    return Chunk(uri, uri.rsplit("/", 1)[-1], start, start + text.count("\n") + 1, text, kind, identifiers(text))


A = chunk("file:///a.py", 0, "def alpha_one(first_arg, second_arg):\n    return first_arg + second_arg\n")
B = chunk("file:///b.py", 0, "class BetaStore:\n    def fetch_item(self, item_key):\n        return item_key\n")
C = chunk("file:///c.py", 0, "GAMMA_LIMIT = compute_gamma(gamma_input, gamma_scale)\n")
CURSOR = identifiers("value = alpha_one(x, y)\nstore = BetaStore()\n")


def test_same_candidates_leave_the_ring_as_it_is():
    ring = Ring()
    assert ring.update([(0.9, A), (0.5, B)], CURSOR, 1000)
    order, version = list(ring.items), ring.version
    for _ in range(5):  # the same refresh again and again: nothing moves
        assert not ring.update([(0.9, A), (0.5, B)], CURSOR, 1000)
        assert not ring.update([(0.5, B), (0.9, A)], CURSOR, 1000)  # another order of the same chunks
    assert ring.items == order and ring.version == version


def test_new_chunks_are_appended_best_last():
    ring = Ring()
    ring.update([(0.9, A), (0.5, B)], CURSOR, 1000)
    assert ring.items == [B, A]  # best nearest the file
    ring.update([(0.99, C), (0.9, A)], CURSOR, 1000)
    assert ring.items == [B, A, C]  # what it held stays in place; the new one goes at the end


def test_eviction_drops_the_oldest_unwanted_first():
    ring = Ring()
    budget = A.tokens + B.tokens
    ring.update([(0.9, A), (0.5, B)], CURSOR, budget)
    assert ring.items == [B, A]
    ring.update([(0.95, C), (0.9, A)], CURSOR, budget)  # B is no longer wanted: it goes, A stays
    assert ring.items == [A, C]


def test_near_duplicates_and_overlaps_are_not_added_twice():
    ring = Ring()
    copy = chunk("file:///copy.py", 0, A.text)  # the same code in another file
    shifted = Chunk(A.uri, A.label, 1, 3, A.text + "# more\n", "tab", identifiers(A.text + "# more\n"))
    ring.update([(0.9, A), (0.85, copy), (0.8, shifted)], CURSOR, 1000)
    assert ring.items == [A]


def test_chunks_too_similar_to_the_cursor_text_are_dropped():
    ring = Ring()
    ring.update([(0.9, A), (0.5, B)], CURSOR, 1000)
    assert A in ring.items
    ring.update([], A.ids, 1000)  # the cursor's text now is A's own text: the prompt has it already
    assert A not in ring.items and B in ring.items


def test_a_refresh_adds_at_most_max_new_and_respects_the_budget():
    many = [chunk(f"file:///m{i}.py", 0, f"def helper_{i}(arg_{i}):\n    return arg_{i}\n") for i in range(10)]
    ring = Ring()
    ring.update([(1.0 - i / 100, c) for i, c in enumerate(many)], frozenset(), 10_000)
    assert len(ring.items) == MAX_NEW
    ring = Ring()
    ring.update([(1.0 - i / 100, c) for i, c in enumerate(many)], frozenset(), many[0].tokens * 2)
    assert ring.tokens <= many[0].tokens * 2 and ring.items == [many[1], many[0]]
    assert not Ring().update([(1.0, A)], CURSOR, A.tokens - 1)  # a chunk over the whole budget: none
