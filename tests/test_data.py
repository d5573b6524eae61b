"""Data readers and loss-mask exactness per chat template (peers-and-tests item 18), offline tiny tokenizers."""

from __future__ import annotations

import json
import logging

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from anchorspec.data import (DROP, KEEP, ReadStats, read_messages_jsonl, read_prompts, read_sharegpt,
                             read_turns_jsonl, render_with_loss_mask, vary_system, with_system)
from anchorspec.errors import AnchorspecError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<s>", "</s>"]

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{{ m.content | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Mistral v0.1 / Llama-2 style: no system role, a system prompt is folded into the first user turn.
MISTRAL = ("{{ bos_token }}{% if messages and messages[0].role == 'system' %}{% set sys = messages[0].content + '\n\n' %}"
           "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
           "{% for m in msgs %}{% if m.role == 'user' %}[INST] {{ sys if loop.first else '' }}{{ m.content }} [/INST]"
           "{% elif m.role == 'assistant' %}{{ m.content }}</s>{% endif %}{% endfor %}")
# (template, bos, end-of-turn token)
TEMPLATES = {"chatml": (CHATML, None, "<|im_end|>"), "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
             "mistral": (MISTRAL, "<s>", "</s>")}

SYSTEM = "You are a careful assistant. Answer briefly."
CONVS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."}],
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Name two colors."},
     {"role": "assistant", "content": "Red and blue."},
     {"role": "user", "content": "And one more?"},
     {"role": "assistant", "content": "Green.\nThat makes three colors."}],
    [{"role": "user", "content": "Count to three."},
     {"role": "assistant", "content": "One, two, three."},
     {"role": "user", "content": "Now say hello in French."},
     {"role": "assistant", "content": "Bonjour! Café ☕ time."},
     {"role": "user", "content": "Thanks a lot."},
     {"role": "assistant", "content": "You are welcome."}],
]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained on a little text, with the templates' special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for c in CONVS for m in c] + ["user assistant system INST the of and to a is in"] * 3
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def make_tokenizer(bpe, name: str) -> PreTrainedTokenizerFast:
    template, bos, _ = TEMPLATES[name]
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=TEMPLATES[name][2],
                                   chat_template=template, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("conv", CONVS, ids=["1turn", "2turn+system", "3turn"])
def test_loss_mask_decodes_to_replies_exactly(bpe, name, conv):
    tok = make_tokenizer(bpe, name)
    eot = TEMPLATES[name][2]
    ids, mask = render_with_loss_mask(tok, conv)
    text = tok.apply_chat_template(conv, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"] and len(mask) == len(ids)
    masked = [i for i, m in zip(ids, mask) if m]
    unmasked = [i for i, m in zip(ids, mask) if not m]
    # Exactly the replies, each with its end-of-turn token; ChatML's trailing "\n" stays unmasked.
    assert tok.decode(masked, skip_special_tokens=False) == "".join(
        m["content"] + eot for m in conv if m["role"] == "assistant")
    rest = tok.decode(unmasked, skip_special_tokens=False)
    for m in conv:
        if m["role"] != "assistant":
            assert m["content"] in rest
    # Masked tokens form one contiguous run per reply, ending on the end-of-turn token.
    eot_id = tok.convert_tokens_to_ids(eot)
    runs = [t for t in range(len(ids)) if mask[t] and (t + 1 == len(ids) or not mask[t + 1])]
    assert len(runs) == sum(m["role"] == "assistant" for m in conv)
    assert all(ids[t] == eot_id for t in runs)


def test_chatml_trailing_newline_not_masked(bpe):
    tok = make_tokenizer(bpe, "chatml")
    ids, mask = render_with_loss_mask(tok, CONVS[2])
    for t in range(len(ids) - 1):
        if mask[t] and not mask[t + 1]:
            assert tok.decode([ids[t + 1]]) == "\n"


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral"])
def test_system_keep_drop_replace(bpe, name):
    tok = make_tokenizer(bpe, name)
    conv = CONVS[1]
    render = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    kept, kmask = render_with_loss_mask(tok, conv, system=KEEP)
    dropped, dmask = render_with_loss_mask(tok, conv, system=DROP)
    replaced, rmask = render_with_loss_mask(tok, conv, system="Be terse.")
    assert SYSTEM in render(kept) and SYSTEM not in render(dropped) and SYSTEM not in render(replaced)
    assert "Be terse." in render(replaced)
    masked = lambda ids, mask: [i for i, m in zip(ids, mask) if m]  # noqa: E731
    assert masked(kept, kmask) == masked(dropped, dmask) == masked(replaced, rmask)
    # A system prompt is inserted even when the conversation had none.
    ids, _ = render_with_loss_mask(tok, CONVS[0], system="Be terse.")
    assert "Be terse." in render(ids)


def test_with_system_and_vary_system():
    conv = CONVS[1]
    assert with_system(conv, KEEP) == conv and with_system(conv, KEEP) is not conv
    assert [m["role"] for m in with_system(conv, DROP)] == ["user", "assistant", "user", "assistant"]
    assert with_system(conv, None) == with_system(conv, DROP)
    assert with_system(CONVS[0], "S")[0] == {"role": "system", "content": "S"}
    convs = CONVS * 10
    choices = ["A", "B", None]
    a, b = vary_system(convs, choices, seed=3), vary_system(convs, choices, seed=3)
    assert a == b
    systems = {c[0]["content"] if c[0]["role"] == "system" else None for c in a}
    assert systems == {"A", "B", None}
    assert vary_system(convs, choices, seed=4) != a
    with pytest.raises(AnchorspecError):
        vary_system(convs, [], seed=0)
    with pytest.raises(AnchorspecError, match="system must be"):
        with_system(conv, 3)


def test_template_not_prefix_stable_raises(bpe):
    # Renders the last assistant turn with an extra marker, as reasoning templates do for history.
    bad = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}[final] "
           "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = make_tokenizer(bpe, "chatml")
    tok.chat_template = bad
    with pytest.raises(AnchorspecError, match="prefix-stable"):
        render_with_loss_mask(tok, CONVS[2])
    # The generation prompt differs from the header the reply is rendered with.
    tok.chat_template = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant {% endif %}")
    with pytest.raises(AnchorspecError, match="prefix-stable"):
        render_with_loss_mask(tok, CONVS[0])


def test_bad_messages_raise(bpe):
    tok = make_tokenizer(bpe, "chatml")
    with pytest.raises(AnchorspecError, match="message 1"):
        render_with_loss_mask(tok, [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}])
    with pytest.raises(AnchorspecError, match="fast tokenizer"):
        render_with_loss_mask(object(), CONVS[0])


# ----------------------------------------------------------------------------- readers

def sharegpt_item(i: int, turns=None) -> dict:
    turns = turns or [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]
    return {"id": f"id{i}", "conversations": turns}


def test_read_sharegpt_roles_and_filters(tmp_path):
    items = [
        sharegpt_item(0),
        sharegpt_item(1, [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"},
                          {"from": "chatgpt", "value": "a"}, {"from": "human", "value": "q2"},
                          {"from": "bing", "value": "a2"}]),
        sharegpt_item(2, [{"from": "gpt", "value": "starts with assistant"}]),  # dropped
        {"id": "empty", "conversations": []},  # dropped
        sharegpt_item(3, [{"from": "human", "value": "q"}, {"from": "tool", "value": "?"},
                          {"from": "gpt", "value": "a"}, {"from": "gpt", "value": "double"}]),  # cut at the break
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(items, indent=2))
    stats = ReadStats()
    convs = list(read_sharegpt(path, stats))
    assert convs[0] == [{"role": "user", "content": "question 0"}, {"role": "assistant", "content": "answer 0"}]
    assert [m["role"] for m in convs[1]] == ["system", "user", "assistant", "user", "assistant"]
    assert convs[2] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert (stats.items, stats.kept, stats.dropped, stats.truncated) == (5, 3, 2, False)


@pytest.mark.parametrize("cut", ["mid_string", "after_comma", "after_element", "mid_key"])
def test_read_sharegpt_truncated_file_yields_complete_items(tmp_path, caplog, cut):
    items = [sharegpt_item(i) for i in range(6)]
    full = json.dumps(items, indent=1)
    last = full.rfind('{\n  "id": "id5"')
    text = {"mid_string": full[: full.rfind("answer 5") + 3],
            "after_comma": full[:last],
            "after_element": full[:last].rstrip().rstrip(","),
            "mid_key": full[: last + 8]}[cut]
    path = tmp_path / "sg.json"
    path.write_text(text)
    stats = ReadStats()
    with caplog.at_level(logging.INFO, logger="anchorspec.data.readers"):
        convs = list(read_sharegpt(path, stats))
    assert [c[0]["content"] for c in convs] == [f"question {i}" for i in range(5)]
    assert stats.items == 5 and stats.truncated
    assert "5 complete items" in caplog.text and "truncated" in caplog.text


def test_read_sharegpt_bad_input(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('{"conversations": []}')
    with pytest.raises(AnchorspecError, match="expected a JSON array"):
        list(read_sharegpt(p))
    p.write_text('[\n{"conversations": []},\n{"conversations": [}\n]')  # closed file: a real syntax error
    with pytest.raises(AnchorspecError, match=r"a.json:3: not valid JSON"):
        list(read_sharegpt(p))
    p.write_text('[\n{"conversations": []},\n{"conv": 1}\n]')
    with pytest.raises(AnchorspecError, match=r"a.json:3: expected an object with a 'conversations' list"):
        list(read_sharegpt(p))
    p.write_text('[{"conversations": [{"from": "human", "value": 3}]}]')
    with pytest.raises(AnchorspecError, match="turn 0"):
        list(read_sharegpt(p))
    with pytest.raises(AnchorspecError, match="does not exist"):
        list(read_sharegpt(tmp_path / "missing.json"))


def test_read_messages_jsonl(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"messages": CONVS[0]}, {"messages": CONVS[1], "extra": 1}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_messages_jsonl(p) == [CONVS[0], CONVS[1]]
    p.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"messages": [{"role": "tool", "content": "x"}]}) + "\n")
    with pytest.raises(AnchorspecError, match=r"m.jsonl:2: message 0"):
        read_messages_jsonl(p)
    p.write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(AnchorspecError, match=r"m.jsonl:2: not valid JSON"):
        read_messages_jsonl(p)


def test_read_turns_jsonl(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question_id": 1, "turns": ["a", "b"]}\n{"turns": ["c"]}\n')
    assert read_turns_jsonl(p) == [["a", "b"], ["c"]]
    p.write_text('{"turns": ["a"]}\n{"turns": [1]}\n')
    with pytest.raises(AnchorspecError, match=r"q.jsonl:2:"):
        read_turns_jsonl(p)


def test_read_prompts_formats(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"question": "q1", "answer": "1"}\n{"question": "q2", "answer": "2"}\n')
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "i1", "output": "o"}, {"instruction": "i2"}], indent=2))
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"prompt": "p1", "question": "not this"}\n')
    assert read_prompts(gsm) == ["q1", "q2"]
    assert read_prompts(alpaca) == ["i1", "i2"]
    assert read_prompts(plain) == ["p1"]
    assert read_prompts(plain, field="question") == ["not this"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q1"}\n{"answer": "no question"}\n')
    with pytest.raises(AnchorspecError, match=r"bad.jsonl:2: expected a string, or an object with a 'prompt'"):
        read_prompts(bad)
    with pytest.raises(AnchorspecError, match=r"bad.jsonl:2: expected an object with a string 'question'"):
        read_prompts(bad, field="question")
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(AnchorspecError, match=r":1: expected a string, or an object"):
        read_prompts(bad)
    alpaca.write_text(json.dumps([{"instruction": "i1"}, {"instruction": "i2"}])[:-5])
    with pytest.raises(AnchorspecError, match="truncated"):
        read_prompts(alpaca)


@pytest.mark.parametrize("rel,reader,n", [("gsm8k/train.jsonl", read_prompts, 7473),
                                          ("alpaca_eval/outputs.json", read_prompts, 805),
                                          ("mt_bench/question.jsonl", read_turns_jsonl, 80)])
def test_real_shared_files(shared_data, rel, reader, n):
    rows = reader(shared_data(rel))
    assert len(rows) == n and all(rows)
