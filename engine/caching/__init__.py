"""Caching: the FIM prompt as memoised, hashable segments (`prompt_plan`), per-document KV caches
under one byte budget with segment borrowing (`kv_store`), and opt-in shift reuse (`kv_shift`)."""
