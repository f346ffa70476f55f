"""``fimble serve``: one engine daemon shared by many editors.

Modules:
- ``protocol``: the wire format (engine/wire.py's msgpack messages over websockets, a
  version handshake first), limits and request checking.
- ``scheduler``: ``ServeEngine``, the scheduler of engine/scheduler.py stepping every active sequence each round
  (continuous batching at step granularity; round-robin where a batch cannot run); ``slot_passes``: its slotted
  CUDA-graph rounds.
- ``session``: one websocket session, answered by engine/host_loop.py's host loop.
- ``batched``: one target forward over many sequences with their own caches and lengths.
- ``daemon``: ``EngineDaemon``, the listeners (websocket sessions, the OpenAI HTTP API) on one port.
- ``openai_http``: ``POST /v1/completions`` (FIM ``suffix``, SSE ``stream``).
- ``client``: ``WSEngine``, the daemon as an engine with EngineProcess's API (``fimble lsp --engine``).
- ``engine_process``: ``ServeEngineProcess``, a ServeEngine in a child process behind the same API (the
  CUDA default: the decode loop and the listeners each get an interpreter).
- ``gc_pauses``: each process's garbage-collector pauses, counted; start-up's objects frozen out of later full
  collections (a full one had stalled every sequence ~0.2-0.3 s under 32 editors).

Build a daemon around an engine::

    from engine.serve.scheduler import open_serve_engine   # or ServeEngine(target, draft) from LoadedModels
    from engine.serve.daemon import EngineDaemon, ServeOptions
    engine = open_serve_engine(model=None, draft=None)   # the default models, as open_engine
    daemon = EngineDaemon(engine, ServeOptions(host="127.0.0.1", port=0, token=None))
    port = daemon.start()                                # listeners in a background thread
    engine.serve_forever()                               # decode loop in the main thread

Or with the decode loop in a child process: ``engine = ServeEngineProcess.start(device="cuda")``, then the
same ``EngineDaemon(engine, ...)`` and ``engine.serve_forever()`` (which waits, and raises if the child dies).

Connect: ``WSEngine("ws://127.0.0.1:%d" % port, token=None)`` (submit/cancel/counters as
EngineProcess), or an OpenAI client with ``base_url="http://127.0.0.1:%d/v1" % port``.
"""
