"""The tiny training world several test modules share: a word-level ChatML tokenizer, conversations of known
words, a tiny Llama target saved with it (the module-scoped `setup` fixture), a TrainConfig over them, and
helpers to read what a run wrote or to interrupt it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from anchorspec.train.trainer import Trainer, TrainConfig
from helpers import VOCAB, tiny_config

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
N_CONVS = 40
DRAFT_VOCAB = 48


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                                chat_template=CHATML, clean_up_tokenization_spaces=False)


def make_conversations(n: int = N_CONVS, seed: int = 0, lo: int = 3, hi: int = 12) -> list[list[dict]]:
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        reply = " ".join(rng.choice(WORDS[:40]) for _ in range(rng.randint(lo, hi)))
        convs.append([{"role": "user", "content": user}, {"role": "assistant", "content": reply}])
    return convs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir, conversations JSONL): a tiny Llama with a peaked LM head (so the target's soft labels are
    learnable, not near-uniform) saved with the ChatML tokenizer, and 40 conversations of known words."""
    root = tmp_path_factory.mktemp("train")
    target_dir = root / "target"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config("llama", layers=4)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(target_dir)
    make_tokenizer().save_pretrained(target_dir)
    data = root / "convs.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in make_conversations()))
    return target_dir, data


def config(setup, out, **kw) -> TrainConfig:
    target_dir, data = setup
    base = dict(target=str(target_dir), data=[str(data)], out=str(out), variant="eagle3.1", ttt_steps=3,
                draft_vocab_size=DRAFT_VOCAB, max_len=64, max_steps=6, lr=3e-3, batch_tokens=64, dtype="float64",
                heldout=0.1, log_every=1, eval_every=1000, save_every=1000, eval_prompts=0, eval_new_tokens=4,
                eval_replay=0, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def drafter_state(path) -> dict:
    """The saved tensors as written (load_drafter would build the module in float32 first)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def run_interrupted(cfg: TrainConfig, monkeypatch, at_step: int) -> None:
    """Run `cfg` as a job killed (KeyboardInterrupt) just before optimizer step `at_step`."""
    original = Trainer.train_step

    def interrupted(self, window):
        if self.step == at_step:
            raise KeyboardInterrupt
        return original(self, window)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            Trainer(cfg).run()
