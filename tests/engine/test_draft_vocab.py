"""Sub-vocabulary drafters (engine/runtimes/draft_vocab.py, mapped_runtime.py): a drafter whose rows are a subset of
its target's vocabulary, run on the ggml runtime with the target's ids. Real models, no mocks: the embedded draft
model's GGUF stands in for the target (8192 tokens), and tiny drafters are built here with transformers.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import DRAFT_DIR, build_tiny_model

from engine.api import CompletionRequest
from engine.errors import ModelLoadError
from engine.options import DecodeOptions
from engine.runtimes.ggml_lib import unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no llama.cpp library: {REASON}")
K = 300  # the random drafter's rows
CODE = (
    "import os\n\n\ndef list_python_files(root):\n    result = []\n    for name in os.listdir(root):\n"
    "        if name.endswith('.py'):\n            result.append(os.path.join(root, name))\n    return result\n"
)
PROMPTS = [
    ("def add(a, b):\n    return ", "\n"),
    ("import os\n\n\ndef list_python_files(root):\n    result = []\n    for name in os.listdir(root):\n", ""),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", "\n"),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The target GGUF, its model on the ggml runtime, and a random drafter folder over a shuffled sub-vocabulary.
    Exports and probes go to a cache folder of this module's own, set for the module's tests (each run's folders
    are new: their exports would pile up in the user's cache)."""
    from engine.loader import load_model
    from engine.runtimes.gguf_export import export_gguf

    root = tmp_path_factory.mktemp("draft_vocab")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FIMBLE_CACHE_DIR", str(root / "cache"))
        target_gguf = export_gguf(DRAFT_DIR, root / "target-q8_0.gguf", "q8_0")
        target = load_model(target_gguf, runtime="ggml")
        folder = build_tiny_model(root / "drafter", vocab_size=K, with_tokenizer=False, tie_word_embeddings=True)
        # The target's control tokens (0-4: end of text, FIM sentinels), bytes and early merges, shuffled so that
        # drafter index and target id differ everywhere.
        ids = list(range(K - 1))
        random.Random(0).shuffle(ids)
        (folder / "token_map.json").write_text(json.dumps([-1, *ids]))
        yield {"root": root, "gguf": target_gguf, "target": target, "folder": folder, "map": [-1, *ids]}


def test_sub_vocabulary_tokenizer_is_a_valid_bpe_and_exports_to_a_loadable_gguf(env):
    from tokenizers import Tokenizer

    from engine.loader import load_model
    from engine.runtimes.draft_vocab import OTHER_TOKEN, write_draft_tokenizer
    from engine.runtimes.gguf_export import export_gguf

    folder, token_map, target = env["folder"], env["map"], env["target"]
    assert write_draft_tokenizer(folder, env["gguf"]) is True
    assert write_draft_tokenizer(folder, env["gguf"]) is False  # same text: left alone (no re-export)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))  # tokenizers refuses merges out of the vocabulary
    assert tok.get_vocab_size() == K and tok.id_to_token(0) == OTHER_TOKEN
    lookup = target.tokenizer.backend_tokenizer.id_to_token
    assert all(tok.id_to_token(d) == lookup(t) for d, t in enumerate(token_map) if d > 0)
    data = json.loads((folder / "tokenizer.json").read_text())
    specials = {a["content"] for a in data["added_tokens"]}
    assert {"<|endoftext|>", "<|fim_pre|>", "<|fim_suf|>", "<|fim_mid|>", OTHER_TOKEN} <= specials
    normal, merges = set(data["model"]["vocab"]) - specials, data["model"]["merges"]
    assert merges and all(a in normal and b in normal and a + b in normal for a, b in merges)

    path = export_gguf(folder, env["root"] / "drafter-q8_0.gguf", "q8_0")
    model = load_model(path, runtime="ggml")
    assert model.backend == "ggml" and model.runtime.vocab == K and len(model.tokenizer) == K


@pytest.fixture(scope="module")
def draft(env):
    from engine.loader import load_draft

    return load_draft(env["folder"], env["target"], runtime="ggml")


def test_logits_are_target_wide_and_finite_only_at_mapped_ids(env, draft):
    from engine.runtimes.ggml_runtime import GGMLRuntime
    from engine.runtimes.mapped_runtime import MappedGGMLRuntime

    target, token_map = env["target"], np.asarray(env["map"])
    rt = draft.runtime
    assert isinstance(rt, MappedGGMLRuntime) and rt.vocab == K  # its own probes use its own size
    assert draft.vocab_size == target.vocab_size and draft.tokenizer is target.tokenizer
    ids = target.encode(CODE)[:40]
    assert any(i in set(env["map"]) for i in ids) and any(i not in set(env["map"]) for i in ids)
    rows = rt.numpy_logits(ids, rt.new_cache(64), 0, 3)
    assert rows.shape == (3, target.runtime.vocab) and rows.dtype == np.float32
    finite = np.isfinite(rows)
    assert finite[:, token_map[1:]].all() and finite.sum() == 3 * (K - 1)
    # The same pass on drafter indices through the parent's own call, scattered here: equal to the bit.
    local = [env["map"].index(i) if i in env["map"] else 0 for i in ids]
    own = GGMLRuntime.numpy_logits(rt, local, rt.new_cache(64), 0, 3)
    expected = np.full_like(rows, -np.inf)
    expected[:, token_map[1:]] = own[:, 1:]
    assert np.array_equal(rows, expected)


def test_a_refilled_draft_cache_maps_its_tokens(env, draft):
    """GGMLCache.copy_prefix_from re-prefills ``ids`` where the source cannot fit the destination: through the
    runtime's numpy_logits, so mapped as any pass."""
    rt = draft.runtime
    ids = env["target"].encode(CODE)[:48]
    src = rt.new_cache(64)
    rt.numpy_logits(ids[:40], src, 0, 1)
    dst = rt.new_cache(32)
    dst.copy_prefix_from(src, 30, ids)  # src holds 40 > 32: the re-prefill path
    assert dst.length == 30
    ref = rt.new_cache(32)
    rt.numpy_logits(ids[:30], ref, 0, 1)
    got, want = (rt.numpy_logits([ids[30]], c, 30, 1) for c in (dst, ref))
    assert np.isfinite(got).sum() == K - 1 and np.array_equal(got, want)


def test_greedy_numpy_drafts_equal_the_torch_path(env, draft):
    """ModelDrafter's numpy path (the ggml engine's, no torch) chooses as the torch path does, gate included."""
    from engine.decoding.drafters import ModelDrafter

    context = env["target"].encode(CODE)[:60]
    for gate in (0.0, 0.05):
        drafts = []
        for numpy_rows in (True, False):
            draft.runtime.numpy_rows = numpy_rows  # (an instance flag: the torch path goes through __call__)
            try:
                drafts.append(ModelDrafter(draft.runtime, 128).propose(context, 6, 0.0, 1.0, gate, None).tokens)
            finally:
                del draft.runtime.numpy_rows
        assert drafts[0] == drafts[1] and set(drafts[0]) <= set(env["map"][1:]), gate
        assert len(drafts[0]) >= 1


def complete(engine, prefix: str, suffix: str, drafter: str):
    opts = DecodeOptions(max_tokens=24, drafter=drafter, gamma=3, adaptive_gamma=False, confidence_gate=0.0)
    request = CompletionRequest(prefix, suffix, opts)
    engine.drafters(request)[1].recent.clear()  # the n-gram drafter's memory must not decide what is drafted
    return engine.complete(request)


def sliced_drafter(folder, token_map: list[int]):
    """The target's own weights with its embedding (tied output) cut to ``token_map``'s rows, row 0 zeros: on
    text inside the map it predicts what the target does, so its drafts are accepted."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    state = load_file(str(DRAFT_DIR / "model.safetensors"))
    emb = state["model.embed_tokens.weight"]
    rows = torch.cat([torch.zeros_like(emb[:1]), emb[torch.tensor(token_map[1:])]])
    save_file({**state, "model.embed_tokens.weight": rows.contiguous()}, str(folder / "model.safetensors"))
    cfg = json.loads((DRAFT_DIR / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": len(token_map)}))
    shutil.copy(DRAFT_DIR / "generation_config.json", folder / "generation_config.json")
    (folder / "token_map.json").write_text(json.dumps(token_map))
    return folder


@pytest.mark.parametrize("kind", ["random", "sliced"])
def test_speculative_completion_with_a_mapped_drafter_equals_plain(env, kind):
    """engine.local.open_engine with a drafter folder: its output equals the target's plain greedy output, and the
    drafter did draft (the sliced one, the target's own weights, also gets drafts accepted)."""
    from engine.local import open_engine
    from engine.runtimes.mapped_runtime import MappedGGMLRuntime

    folder = env["folder"]
    if kind == "sliced":
        ids = list(range(4095))
        random.Random(1).shuffle(ids)
        folder = sliced_drafter(env["root"] / "sliced", [-1, *ids])
    spec = open_engine(model=env["gguf"], draft=folder, start_thread=False, runtime="ggml")
    plain = open_engine(model=env["gguf"], use_draft=False, start_thread=False, runtime="ggml")
    try:
        assert isinstance(spec.draft.runtime, MappedGGMLRuntime) and plain.draft is None
        drafted = accepted = 0
        for prefix, suffix in PROMPTS:
            a, b = complete(spec, prefix, suffix, "model"), complete(plain, prefix, suffix, "none")
            assert a.text == b.text and a.tokens == b.tokens, prefix
            drafted, accepted = drafted + a.stats["drafted"], accepted + a.stats["accepted"]
        assert drafted > 0
        if kind == "sliced":
            assert accepted > 0
    finally:
        spec.close()
        plain.close()


# The engine child (engine/process.py, as fimble lsp starts it), then a report of what it imported
# (tests/engine/test_start_path.py's pattern).
CHILD = """
import json, sys
from engine.process import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "torch": "torch" in sys.modules}, f)
"""


def test_the_engine_child_drafts_with_a_mapped_drafter_without_torch(env, draft, tmp_path):
    """Greedy completions with the drafter through the real engine process (its GGUF exported and probed already,
    by the ``draft`` fixture, in this module's cache): the ModelDrafter's numpy path, no torch import."""
    import sys

    from engine.process import EngineProcess

    report = tmp_path / "report.json"
    args = ["--model", str(env["gguf"]), "--draft", str(env["folder"])]
    eng = EngineProcess(command=[sys.executable, "-c", CHILD, str(report), *args])
    try:
        drafted = 0
        for prefix, suffix in PROMPTS[:2]:
            opts = DecodeOptions(max_tokens=12, drafter="model", gamma=3, adaptive_gamma=False, confidence_gate=0.0)
            stream = eng.submit(CompletionRequest(prefix, suffix, opts))
            stream.collect()
            assert stream.result is not None and stream.result.tokens > 0
            drafted += stream.result.stats["drafted"]
        assert drafted > 0
    finally:
        eng.close()
    assert json.loads(report.read_text()) == {"code": 0, "torch": False}


def test_a_mapped_drafter_needs_a_ggml_target(env):
    from engine.loader import load_draft, load_model

    compact = load_model(env["gguf"], runtime="compact")
    with pytest.raises(ModelLoadError, match="ggml"):
        load_draft(env["folder"], compact)


def test_default_models_pair_the_qwen_target_with_its_installed_drafter(tmp_path, monkeypatch):
    import engine.loader as loader
    from engine import model_info

    fim = tmp_path / "qwen" / model_info.QWEN_FIM_NAME
    fim.parent.mkdir()
    fim.write_bytes(b"GGUF")
    (fim.parent / "SOURCE.txt").write_text("output_sha256 ...")
    monkeypatch.setattr(model_info, "QWEN_TARGET", fim.parent / "instruct-q8_0.gguf")
    monkeypatch.setattr(model_info, "BUILT_TARGET", tmp_path / "no-smollm2")
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "qwen")
    drafter = tmp_path / model_info.QWEN_DRAFT_NAME  # beside the Qwen folder, as models/ holds both
    drafter.mkdir()
    assert loader.default_models() == (fim, None)  # no token map: not a drafter (yet)
    (drafter / "token_map.json").write_text("[-1, 0]")
    assert loader.default_models() == (fim, drafter)
    monkeypatch.setenv("FIMBLE_DEFAULT_MODEL", "embedded")
    assert loader.default_models() == (loader.DEFAULT_TARGET, loader.DEFAULT_DRAFT)


def test_a_qwen_sub_vocabulary_keeps_its_sentinels_as_special_tokens(tmp_path):
    from engine.model_info import qwen_fim_target
    from engine.runtimes.draft_vocab import write_draft_tokenizer

    qwen = qwen_fim_target()
    if not qwen.is_file():
        pytest.skip("the FIM-tuned Qwen2.5-Coder GGUF is not installed")
    build_tiny_model(tmp_path, vocab_size=K, with_tokenizer=False, tie_word_embeddings=True)
    sentinels = list(range(151659, 151665)) + [151643]  # FIM prefix..file separator, end of text
    (tmp_path / "token_map.json").write_text(json.dumps([-1, *sentinels, *range(K - 1 - len(sentinels))]))
    write_draft_tokenizer(tmp_path, qwen)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    added = {a["content"]: a["id"] for a in data["added_tokens"]}
    assert added["<|fim_prefix|>"] == 1 and added["<|endoftext|>"] == 7 and len(added) == 8
    assert len(data["model"]["vocab"]) == K and data["model"]["merges"]


def test_a_cold_draft_cache_waits_for_the_first_tokens():
    """A draft model whose cache lacks more of the context than it prefills in DEFER_SYNC_S does not draft (so does
    not prefill) before the completion's first DEFER_UNTIL_PRODUCED tokens; a warm one drafts at once."""
    from types import SimpleNamespace

    from engine.decoding.draft_plan import DEFER_SYNC_S, DEFER_UNTIL_PRODUCED, DraftPlan
    from engine.decoding.drafters import ModelDrafter
    from engine.options import DecodeOptions

    runtime = SimpleNamespace(cost_aware_drafting=False)  # no cost probe: the rate is set below
    drafter = ModelDrafter(runtime, 0)
    plan = DraftPlan(runtime, DecodeOptions(drafter="model", max_tokens=64), drafter, None)
    plan.draft_prefill_rate = 1000.0  # tokens a second: 100 tokens is the limit
    limit = int(DEFER_SYNC_S * plan.draft_prefill_rate)
    ids = list(range(500))
    assert plan.choose(ids, 0, 4096).tokens == []  # 500 tokens to prefill: deferred
    assert plan.choose(ids, DEFER_UNTIL_PRODUCED, 4096) > 0  # the first tokens are out: it drafts
    drafter.ids = ids[: len(ids) - limit]  # warm but for `limit` tokens: drafts at once
    assert plan.choose(ids, 0, 4096) > 0
    drafter.ids = ids[: len(ids) - limit - 1]
    assert plan.choose(ids, 0, 4096).tokens == []
    plan.draft_prefill_rate = 0.0  # unknown rate: never deferred
    assert plan.choose(ids, 0, 4096) > 0


# The default model's lossless check: 200 prompts is the bar, in the heavy suite (tests/heavy.sh; about 16
# minutes on 2 cores, 4.7 s a prompt); the default suite checks the first DEFAULT_QWEN_PROMPTS of them (8 s alone; 4
# prompts took 17 s alone and 27 s in the full run).
QWEN_PROMPTS = 200
DEFAULT_QWEN_PROMPTS = 2


@pytest.mark.parametrize("n", [pytest.param(QWEN_PROMPTS, marks=pytest.mark.heavy), DEFAULT_QWEN_PROMPTS])
def test_default_model_with_its_drafter_is_lossless(monkeypatch, n):
    """The default model (Qwen2.5-Coder-0.5B FIM, q8_0) with its shipped sub-vocabulary drafter: greedy speculative
    decoding (model, n-gram and auto drafters, healing on) equals plain greedy token for token. Where the install
    step has run (skipped in CI, which installs no Qwen files)."""
    from lossless_check import compare_drafters

    from bench.harness.prompts import fim_prompts
    from engine.loader import load_draft, load_model
    from engine.model_info import qwen_draft, qwen_fim_target
    from engine.runtimes.draft_vocab import is_mapped_draft

    if not qwen_fim_target().is_file() or not is_mapped_draft(qwen_draft()):
        pytest.skip("the default Qwen files are not installed (python -m training.fetch_qwen)")
    # Every prompt here is new to the drafter, so the draft plan would hold its drafts back for the first 16 tokens
    # (draft_plan.DEFER_UNTIL_PRODUCED), most of these short completions: this check is about the drafts.
    monkeypatch.setattr("engine.decoding.draft_plan.DEFER_UNTIL_PRODUCED", 0)
    target = load_model(qwen_fim_target())
    draft = load_draft(qwen_draft(), target)
    result = compare_drafters(target, draft, fim_prompts(n, window=600))
    print(f"\nQwen default + drafter, {n} prompts: {result.summary()}")
    assert not result.mismatches and result.ties == 0, result.mismatches[:2]
    assert result.mean_accepted("model") > 1.2
