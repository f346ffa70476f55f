"""bench/harness/prompts.py, the inputs of bench/vs_llamacpp.py: cold prompts in several languages with a real
middle removed, and a fixed typing trace (issue 24 asks for cold prompts of code in >= 3 languages)."""

from bench.harness.llamacpp_report import language_rates
from bench.harness.prompts import COLD_MIDDLE_CHARS, cold_prompts, language_files, typing_files


def test_cold_prompts_take_the_languages_in_turn_and_remove_whole_lines():
    files = language_files()
    assert len(files) >= 3  # the bar's "code in >= 3 languages"
    texts = {lang: [f.read_text() for f in fs] for lang, fs in files.items()}
    cuts = cold_prompts(12, seed=3)
    assert [lang for lang, _, _ in cuts] == (list(files) * 3)[:12]
    for lang, prefix, suffix in cuts:
        source = next(t for t in texts[lang] if prefix in t and suffix in t)
        start = source.index(prefix) + len(prefix)
        middle = source[start : source.index(suffix, start)]
        assert prefix.endswith("\n") and middle.endswith("\n")  # whole lines, cursor at a line start
        assert len(middle) >= COLD_MIDDLE_CHARS
        assert len(suffix) > 0


def test_no_middle_puts_the_suffix_at_the_cursor():
    for lang, prefix, suffix in cold_prompts(8, seed=1, middle=0):
        assert any(prefix + suffix in f.read_text() for f in language_files()[lang])


def test_the_typing_trace_is_fixed_and_spans_languages():
    first = typing_files(3)
    assert [f.name for f in first] == ["local.py.txt", "extension.ts", "init.lua"]  # the same files every run
    suffixes = {f.suffix for f in first}
    assert len(suffixes) == 3 and all(f.stat().st_size > 4000 for f in first)


def test_language_rates_sum_each_languages_prompts():
    run = {
        "prompt_languages": ["python", "lua", "python"],
        "cold": {"a": {"tokens": [11, 21, 31], "decode_s": [1.0, 2.0, 2.0]}},
    }
    assert language_rates(run) == {"a": {"python": 40 / 3.0, "lua": 10.0}}
