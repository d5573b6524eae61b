"""Tiny random targets of several families and test-only proposers (oracle) for exactness tests."""

from __future__ import annotations

import os

import torch
import transformers

from anchorspec.decode.tree import DraftTree, TreeShape, build_dynamic_tree
from anchorspec.models.attention import use_grouped_attention
from anchorspec.models.target import Target
from device_emulation import test_device

VOCAB = 96
# Six families with different blocks: Llama; Qwen2 (qkv bias); Qwen3 (q/k norm); Mistral; OLMo2
# (post-norms); Granite (scaled residuals, embeddings and logits).
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0, "eos_token_id": None}),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0}),  # rescales logits after the LM head
}


def tiny_config(family: str = "llama", layers: int = 6, **overrides):
    cls_name, extra = FAMILIES[family]
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kwargs.update(extra)
    kwargs.update(overrides)
    return getattr(transformers, cls_name)(**kwargs)


def tiny_target(family: str = "llama", dtype=torch.float64, seed: int = 0, peaked: float = 4.0,
                stock: bool = False) -> Target:
    """A random model whose logits are sharpened (`peaked`) so greedy paths are not near ties. Its
    attention is the project's grouped-query SDPA, as load_target gives a CPU target (`stock`: transformers')."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(peaked)
    if not stock:
        use_grouped_attention(model)
    # ANCHORSPEC_TEST_DEVICE=cuda runs the tiny-model tests on a GPU (the device machine), =emulated on a
    # CPU under CUDA's device rules (tests/device_emulation.py); unset: the CPU
    return Target(test_device(model.to(dtype=dtype)).eval())


class OracleProposer:
    """Drafts what the target itself would say: full recompute, no cache (tiny models only).

    Chain: the target's greedy continuation. Tree: the target's own top-k at every node, scored
    0 for the argmax and -1, -2, ... for the others, so the greedy path always leads the EAGLE-2
    frontier and survives pruning. Every draft must be accepted: tau = depth + 1.
    """

    def __init__(self, target: Target):
        self.target = target
        self.tokens = None

    def reset(self):
        self.tokens = None

    def update(self, tokens, aux):
        self.tokens = tokens.clone()

    @torch.inference_mode()
    def _top(self, prefix: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.target.model(torch.tensor([prefix], device=self.target.embed_weight.device)).logits[0, -1]
        return torch.topk(logits, k).indices, -torch.arange(k, dtype=torch.float64)

    def propose(self, shape: TreeShape, params, generator) -> DraftTree:
        context = self.tokens.tolist()
        prefixes = {-1: context}

        def expand(nodes, toks, parents):
            out_t, out_l = [], []
            for node, tok, parent in zip(nodes, toks, parents):
                prefixes[node] = prefixes[parent] + [tok]
                tokens, scores = self._top(prefixes[node], shape.top_k)
                out_t.append(tokens)
                out_l.append(scores)
            return torch.stack(out_t), torch.stack(out_l)

        return build_dynamic_tree(context[-1], *self._top(context, shape.top_k), expand, shape)


# ChatML without a default system prompt: prefix-stable, so render_with_loss_mask can mask replies.
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_ROLES = ["system", "user", "assistant"]
# Plain words of the tiny chat tokenizer: w0 .. w{VOCAB - 7} (ids 6 ..); content should use only these.
CHAT_WORDS = [f"w{i}" for i in range(VOCAB - len(CHAT_SPECIALS) - len(CHAT_ROLES))]


def tiny_chat_tokenizer(roundtrip: bool = False):
    """A fast word-level tokenizer (whitespace split) over CHAT_WORDS with a ChatML template, eos <|im_end|>.
    ``roundtrip``: spaces and newlines are tokens of their own (the last two CHAT_WORDS give up their ids),
    so decode(encode(text)) == text, as for real byte-level tokenizers; content may use CHAT_WORDS[:-2]."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    words = [" ", "\n"] + CHAT_WORDS[:-2] if roundtrip else CHAT_WORDS
    vocab = CHAT_SPECIALS + CHAT_ROLES + words
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    if roundtrip:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("[ \n]"), behavior="isolated")
        tok.decoder = decoders.Fuse()  # tokens concatenated as they are
    else:
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                                chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return fast


def save_tiny_chat_target(path, family: str = "llama", dtype=torch.float64, seed: int = 0, roundtrip: bool = False):
    """Save a tiny random target (see tiny_target) plus tiny_chat_tokenizer(roundtrip) to ``path``, loadable by
    load_target and the CLI; the model's eos is the template's end-of-turn token. Returns ``path``."""
    tokenizer = tiny_chat_tokenizer(roundtrip)
    model = tiny_target(family, dtype=dtype, seed=seed).model
    eos = tokenizer.eos_token_id
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_conversations(n: int = 24, seed: int = 0) -> list[list[dict]]:
    """``n`` seeded two-turn [user, assistant] conversations over CHAT_WORDS (no system prompt)."""
    import random

    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(CHAT_WORDS) for _ in range(rng.randint(lo, hi)))

    return [[{"role": "user", "content": text(2, 6)}, {"role": "assistant", "content": text(3, 9)}] for _ in range(n)]


def write_conversations_jsonl(path, n: int = 24, seed: int = 0):
    """tiny_conversations as ``{"messages": [...]}`` JSONL at ``path``; returns ``path``."""
    import json
    from pathlib import Path

    Path(path).write_text("".join(json.dumps({"messages": c}) + "\n" for c in tiny_conversations(n, seed)))
    return path


def prompts(n=2, length=10, seed=0):
    """`n - 1` random prompts and a repetitive one."""
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, VOCAB, (length,), generator=gen) for _ in range(n - 1)]
    out.append(torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 7, 5]))  # repetitive
    return out


def random_drafter(target, variant="eagle3.1", seed=1):
    """A drafter of random weights attached to `target` (float64; a 64-token draft vocabulary)."""
    from anchorspec.api import attach_drafter
    from anchorspec.models.drafter import init_drafter

    drafter = init_drafter(target.config, variant, draft_vocab_size=64, seed=seed).to(torch.float64)
    attach_drafter(target, drafter)
    return drafter

