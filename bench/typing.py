"""bench/typing.py: a person typing real files into ``fimble lsp`` as VS Code drives it (issue 23, item 7).

    python bench/typing.py --quick --model embedded   # under a minute
    python bench/typing.py --model default --json out.json

A request per key with the previous one cancelled, ~110 ms between keys, pauses after the
indentation of new lines and at some word ends; it reports the time from the last key of each pause
to the first visible text (p50/p90, the share within 300 ms and 1 s), the time to the next text after
a Tab accept, the cold wait to the first text after start, engine restarts and the server's CPU
seconds per second. The code, and what exactly is measured, is in bench/lsp_typing.py.

Why this file is only an entry point: ``python bench/<any script>.py`` puts bench/ first on
sys.path, so a file named typing.py here is what ``import typing`` finds, in every bench script
(and in the stdlib modules they import: asyncio, dataclasses, ...). When imported under the name
``typing``, this file therefore loads the standard library's typing in its own place and does
nothing else; run as a script, it runs bench/lsp_typing.py's main.
"""

if __name__ == "typing":  # found on sys.path in place of the standard library's module: hand over to it
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    _spec = importlib.machinery.PathFinder.find_spec("typing", _path)
    if _spec is None or _spec.loader is None:
        raise ImportError("the standard library's typing module was not found")
    _real = importlib.util.module_from_spec(_spec)
    sys.modules["typing"] = _real  # what the import statement that found this file returns
    _spec.loader.exec_module(_real)
else:
    import importlib.util
    import os
    import sys

    _name = "fimble_bench_lsp_typing"
    if _name not in sys.modules:
        _spec = importlib.util.spec_from_file_location(
            _name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lsp_typing.py"))
        _mod = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = _mod  # (its dataclasses look their module up)
        _spec.loader.exec_module(_mod)
    main = sys.modules[_name].main

    if __name__ == "__main__":
        sys.exit(main())
