"""The evaluation filter: every evaluation prompt is caught after perturbation, and unrelated or
merely similar text is not (negative controls)."""

from pathlib import Path

import pytest

from anchorspec.data.decontaminate import (NGRAM, EvalFilter, FilterReport, clean_conversations, eval_prompts,
                                           words)
from anchorspec.errors import AnchorspecError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

LONG = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
        "experiences and must-see attractions.")
SHORT = "Who played anna in once upon a time?"  # 9 words: contained as a whole
TINY = "Can you parallelize it?"  # 4 words: only a text that is exactly it


def user(text):
    return [{"role": "user", "content": text}]


def test_words_normalise_case_punctuation_and_unicode():
    assert words("  Hello,\tWORLD!! ﬁne—42 ") == ["hello", "world", "fine", "42"]


def test_perturbed_and_embedded_prompts_are_caught():
    f = EvalFilter.from_texts([LONG, SHORT, TINY])
    assert f.matches(LONG)
    assert f.matches(LONG.upper().replace(",", " ;"))
    assert f.matches("Hi! Please do this for me:\n\n" + LONG + "\nThanks a lot.")
    # a 13-word window of the long prompt is enough
    assert f.matches("blah " + " ".join(words(LONG)[3:3 + NGRAM]) + " blah")
    assert f.matches("quiz time: WHO played Anna in 'Once Upon a Time'??")
    assert f.matches("can you PARALLELIZE it")


def test_negative_controls_are_not_caught():
    f = EvalFilter.from_texts([LONG, SHORT, TINY])
    assert not f.matches("Write a haiku about autumn leaves.")
    # 12 consecutive words of the long prompt: one short of the rule
    assert not f.matches(" ".join(words(LONG)[:NGRAM - 1]))
    # the short prompt with one word changed
    assert not f.matches("Who played elsa in once upon a time?")
    # a tiny prompt inside a longer text is a generic phrase, not contamination
    assert not f.matches("Here is my loop over the files. Can you parallelize it? It is slow.")


def test_clean_conversations_dedupes_and_reports():
    f = EvalFilter.from_texts([LONG])
    convs = [user("Tell me a joke."), user("tell me a JOKE"), user("Sure: " + LONG),
             [{"role": "system", "content": "x"}, {"role": "user", "content": "Another"},
              {"role": "assistant", "content": LONG}]]  # only user turns are checked
    report = FilterReport()
    kept = list(clean_conversations(convs, f, report))
    assert [c[-1]["content"] if c[-1]["role"] == "user" else c[1]["content"] for c in kept] == ["Tell me a joke.", "Another"]
    assert (report.kept, report.duplicates, report.contaminated) == (2, 1, 1)


def test_missing_eval_data_is_one_clear_error(tmp_path):
    with pytest.raises(AnchorspecError, match="no evaluation sets"):
        EvalFilter.from_data_dir(tmp_path)


@pytest.mark.skipif(not DATA.is_dir(), reason=f"evaluation data not found at {DATA} (../shared/data)")
def test_every_evaluation_prompt_is_caught_after_perturbation():
    f = EvalFilter.from_data_dir(DATA)
    assert {"mt_bench/question.jsonl", "gsm8k/test.jsonl", "humaneval/HumanEval.jsonl.gz",
            "eagle_eval/alpaca/question.jsonl"} <= set(f.sources)
    total = 0
    for rel, texts in eval_prompts(DATA).items():
        for text in texts:
            total += 1
            assert f.matches(text), (rel, text[:80])
            if len(words(text)) >= 6:  # generic tiny follow-ups only match whole (see the module doc)
                wrapped = "Question from my homework:\n" + text.upper().replace("?", " ?") + "\nPlease help."
                assert f.matches(wrapped), (rel, text[:80])
    assert total > 2000
