"""The keystroke path's owners, as checks (lsp_server/completer.py's pipeline).

Every CompletionShaper the LSP side builds is built in lsp_server/shaping/stage.py (the shaping stage);
the syntax policy is asked only by the plan recipe (lsp_server/plan.py), which also builds the engine
request of every editor decode (requests, prefetches, follow-ups, pre-warms); ``fimble complete``
(lsp_server/cli.py) takes the recipe's plan and builds its one-shot request itself. A fourth place that
shapes, decides or builds a request by its own recipe fails here: it would drift from the others.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWNERS = {
    "CompletionShaper": {"lsp_server/shaping/stage.py"},
    "decide": {"lsp_server/plan.py"},
    "decide_for_context": set(),  # the table lookup alone: only decide (in its own module) uses it
    "classify": {"lsp_server/plan.py"},
    "CompletionRequest": {"lsp_server/plan.py", "lsp_server/cli.py"},
}
# Where a name is defined (or, for classify, the syntax layer that shapes with it): calls there are the
# definition's own business.
DEFINED_IN = ("lsp_server/shaping/policy.py", "lsp_server/shaping/shaper.py", "lsp_server/shaping/syntax/")


def calls_by_file() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for path in (REPO / "lsp_server").rglob("*.py"):
        rel = str(path.relative_to(REPO))
        if rel.startswith(DEFINED_IN):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in OWNERS:
                    found[name].add(rel)
    return found


def test_each_stage_has_one_owner():
    found = calls_by_file()
    assert found["CompletionShaper"] and found["decide"] and found["CompletionRequest"]  # the scan sees them
    assert {name: found.get(name, set()) for name in OWNERS} == OWNERS
