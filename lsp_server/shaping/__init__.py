"""What the editor's document decides about a completion, on the LSP side of the engine API.

- ``syntax/``: tree-sitter documents kept in step with the editor's, the cursor's context, bracket rules,
  completion validation.
- ``policy.py``: the cursor's context -> the decoding options a request carries (``decide``).
- ``shaper.py``: ``CompletionShaper``, the streamed text -> what the editor shows (bracket guard while
  streaming, validation and replace range at the end).

None of it imports torch or anything behind the engine API but plain data (``engine.options``): the
engine process never reads a document's syntax; the LSP process does, once per keystroke.
"""
