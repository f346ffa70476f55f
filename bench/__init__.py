"""fimble's benchmarks, one module per comparison, run from the repository root as ``python -m bench.NAME``.

Each prints a table with its headline as the last line, takes ``--quick`` (a short run) and ``--json PATH`` (the
figures as JSON); their reports are in bench/reports/, one per comparison. What several benchmarks (and the tests)
drive fimble with lives in bench/harness/: random-weight models, FIM prompts, cursor sets, the llama.cpp peer, a raw LSP
client. A benchmark imports the product as any client would (engine/, lsp_server/), never tests/.
"""
