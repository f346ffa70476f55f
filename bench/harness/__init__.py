"""What the benchmarks (bench/) and the tests (tests/) both drive fimble with, kept apart from both.

- ``random_models``: Qwen2.5-shaped models with random weights (0.5B / 1.5B / 7B), built on the GPU from their
  configs with no download;
- ``prompts``: FIM prompts cut from the frozen corpus (tests/data/lossless_corpus), and the mixed HumanEval /
  standard-library prompts of the decoding-speed benchmarks;
- ``cursor_sets``: quality cursor sets beyond HumanEval's single lines (block bodies, held-out files);
- ``llamacpp_peer``: llama.cpp as the peer of a comparison (llama-cpp-python out of process, llama-server);
- ``raw_lsp``: a blocking JSON-RPC client for a real ``fimble lsp`` over stdio, and the event-loop pinger.

Why a package of its own: bench/ and tests/ must not import each other (a benchmark would run test code, a test
would depend on a script's flags and side effects), yet both need these. This package imports the product
(engine/, lsp_server/) and training/ where a helper needs it, never bench/ or tests/; it is not installed with the
product (pyproject.toml lists engine and lsp_server only): it is found from the repository root, where
``python -m bench.NAME`` and ``python -m pytest`` run (pytest's ``pythonpath`` setting).
"""
