"""Decoding: the speculative loop (`speculative`), its drafters (`drafters`), sampling and the
speculative-sampling acceptance rule (`sampling`), token healing at the cursor (`healing`), and
incremental detokenisation with stop rules (`detok`)."""
