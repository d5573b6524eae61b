"""The small Python API.

    from anchorspec import load
    engine = load("smollm2-135m-instruct", drafter="checkpoints/...", dtype="float32")
    result = engine.generate("Why is the sky blue?", chat=True, max_new_tokens=64)
    print(result.text, result.stats.tau)

`drafter=None` gives plain decoding with the project's own loop. With a drafter, generation falls
back to plain steps while speculation does not pay on this machine (decode/fallback.py;
`fallback=False` speculates at every step), and without a given or tuned shape it drafts the chain
that the measured costs and acceptance favour.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .data.chat import prompt_ids
from .decode.adaptive import depth_controller
from .decode.engine import (GenerationConfig, GenerationResult, SpeculativeDecoding, generate_prompt_lookup,
                            generate_speculative, generate_vanilla)
from .decode.fallback import TREE_CANDIDATES, StreamMonitor
from .decode.lookup import LookupSettings
from .decode.propose import EagleProposer
from .decode.sampling import SamplingParams
from .decode.shape import costs_path, load_costs, save_costs
from .decode.tree import TreeShape
from .errors import AnchorspecError
from .metrics import GenerationStats
from .models.drafter import Eagle3Drafter, load_drafter
from .models.hub import resolve_target, switched_on
from .models.packed import is_packed, pack_linears, packing_supported
from .models.dtype import model_shapes, resolve_packing, resolve_target_dtype
from .models.compiled import COMPILE_PAYS_AT, graphs_compiled
from .models.target import Target, default_aux_layer_ids, load_target, pack_if_faster

# The server's and `tune`'s starting shape. CPU-sized: a 16-token verification costs ~1.6x a decode step
# here, 32 tokens ~2.2x (benchmarks/bench_core.py); EAGLE's GPU default (10, 7, 60) would need tau > 4
# just to break even. Single-stream generation measures its own instead (Engine.shape).
DEFAULT_TREE = TreeShape(top_k=4, depth=4, total_tokens=16)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


def attach_drafter(target: Target, drafter: Eagle3Drafter) -> None:
    """Check that a drafter fits a target, then share the embedding and set the aux layers."""
    c = drafter.config
    if c.target_hidden_size != target.hidden_size:
        raise AnchorspecError(
            f"drafter target_hidden_size={c.target_hidden_size} but the target's hidden size is {target.hidden_size}"
        )
    if c.vocab_size != target.vocab_size:
        raise AnchorspecError(f"drafter vocab_size={c.vocab_size} but the target's vocabulary has {target.vocab_size} tokens")
    if c.hidden_size != target.embed_weight.shape[1]:
        raise AnchorspecError(
            f"drafter hidden_size={c.hidden_size} differs from the target embedding width {target.embed_weight.shape[1]}"
        )
    aux = tuple(c.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(target.num_layers))
    if getattr(drafter, "embed_weight", None) is target.embed_weight and target.aux_layer_ids == aux:
        return  # attached already (`load` attaches before compiling, then Engine is handed the pair)
    target.set_aux_layers(aux)
    drafter.to(target.embed_weight.device)  # the drafter reads the target's states where they are
    drafter.bind_target_embedding(target.embed_weight)


class Engine:
    def __init__(self, target: Target, drafter: Eagle3Drafter | None = None, shape: TreeShape | None = None,
                 fallback: bool = True, costs_file: Path | None = None, pack_drafter: bool | None = None):
        """`costs_file`: where the stream monitor's costs and acceptance are kept between processes
        (decode/shape.py: costs_path); None keeps them for this engine's life only. `pack_drafter`: prepack
        an uncompiled drafter's linear layers for oneDNN (the packing verdict for the target's dtype, as
        `load` resolves it); None: as the target's weights are, since both run the same dtype's GEMMs."""
        self.target = target
        self.drafter = drafter
        self._shape = shape  # None: measured on first use (see `shape`)
        self._sampled_shape: TreeShape | None = None  # the measured chain sampled decoding drafts (shape_for)
        self.shape_source = "given" if shape else "measured"
        self.proposer = None
        self.monitor: StreamMonitor | None = None  # this engine's costs and acceptance, across generations
        self.costs_file = costs_file if drafter is not None else None
        self.costs_source = "calibrated here"  # or the file an earlier process left
        if drafter is not None:
            attach_drafter(target, drafter)
            if pack_drafter is None:
                pack_drafter = is_packed(target.model)
            weight = drafter.fc.weight
            if (pack_drafter and not drafter.compiled and not is_packed(drafter)
                    and packing_supported(weight.dtype, weight.device)):
                pack_linears(drafter, keep_weights=True)  # a compiled drafter's frozen graph packs its own
            self.proposer = EagleProposer(drafter)
            self.monitor = StreamMonitor(enabled=fallback)
            state = load_costs(costs_file) if costs_file is not None else None
            if state is not None and self.monitor.restore(state) and self.monitor.calibrated:
                self.costs_source = f"learned by earlier runs ({costs_file})"

    @property
    def shape(self) -> TreeShape:
        """The shape generate() drafts with when given none: the given or tuned one, else the chain whose
        expected speed (measured costs, acceptance learned from earlier generations) is best; the
        first look calibrates the costs (a few timed forwards)."""
        if self._shape is not None and not self.shape_source.startswith("measured"):
            return self._shape
        if self.monitor is None:
            return DEFAULT_TREE  # no drafter: nothing drafts with it
        if not self.monitor.calibrated:
            self.monitor.calibrate(self.target, self.proposer)
            self.remember()
        self.monitor.select(SamplingParams())  # the shape is greedy decoding's (shape_for: sampled)
        self._shape, speedup = self.monitor.choose_shape(current=self._shape)
        self.shape_source = f"measured: expected {speedup:.2f}x plain on this machine's costs ({self.costs_source})"
        return self._shape

    @shape.setter
    def shape(self, value: TreeShape) -> None:
        self._shape = value

    def shape_for(self, sampling: SamplingParams) -> TreeShape:
        """The shape generate() drafts with for `sampling` when given none: `shape`, except that a
        measured choice for sampled decoding is its own, priced on what sampled steps accepted
        (StreamMonitor.select), over chains only (candidate_trees)."""
        shape = self.shape
        if sampling.greedy or not self.shape_source.startswith("measured"):
            return shape
        self.monitor.select(sampling)  # priced on what sampled steps accepted
        self._sampled_shape, speedup = self.monitor.choose_shape(trees=self.candidate_trees(sampling),
                                                                 current=self._sampled_shape)
        self.shape_source = (f"measured, chains only when sampling: expected {speedup:.2f}x plain on this "
                             f"machine's costs ({self.costs_source})")
        return self._sampled_shape

    @staticmethod
    def candidate_trees(sampling: SamplingParams) -> tuple[TreeShape, ...]:
        """The trees a measured choice prices beside the chains: none when sampling. With the greedy tree
        prior, on 16 MT-bench prompts at T=1 the costs' tree choice ran at 1.12x the plain loop against
        1.26x for chains only (session 39); priced on sampled steps' own ratio, on 27 (alternating with
        greedy requests) at 0.99x of chains only, median per prompt (round 24, bf16, session 73)."""
        return TREE_CANDIDATES if sampling.greedy else ()

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Trace every graph family a generation can meet, so that a compiled target or drafter (which
        compiles each family on first use, tens of seconds) does not compile in the middle of one: plain
        decoding, and with a drafter a prefill, a chain step and a step of each candidate tree, a plain
        step inside the speculative loop (the fallback's: it captures the target's features, so it is
        not plain decoding's graph; `--compile` compiled it mid-run on MT-bench, session 44) and the
        drafter's catch-up after it. An AOT-compiled target (a CPU's) has one graph for all of these:
        building or loading it is the whole warm-up, unless the drafter is torch-compiled too. Returns
        the graphs compiled (or loaded)."""
        before = graphs_compiled()
        if self.target.aot and (self.drafter is None or self.drafter.aot or not self.drafter.compiled):
            self.target.load_graph()  # one graph serves every step: building or loading it is the whole warm-up
            if self.drafter is not None and self.drafter.aot:
                self.drafter.load_graph()  # and one every drafter pass past the prompt
            return graphs_compiled() - before
        prompt = torch.arange(1, 25) % self.target.vocab_size
        cfg = GenerationConfig(max_new_tokens=64)  # no stop token: every step below has tokens to decode
        generate_vanilla(self.target, prompt, cfg)
        if self.proposer is not None:
            dec = SpeculativeDecoding(self.target, self.proposer, prompt, cfg, TreeShape.chain(2))
            dec.step()  # the prefill
            for speculate, shape in ((True, TreeShape.chain(2)), *((True, t) for t in TREE_CANDIDATES),
                                     (False, None), (True, TreeShape.chain(2))):
                dec.step(speculate, shape)
        return graphs_compiled() - before

    def remember(self) -> None:
        """Save what the monitor has learned to `costs_file` (if any), for the next process."""
        if self.costs_file is not None and self.monitor is not None:
            save_costs(self.costs_file, self.monitor.state())

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise AnchorspecError("this target has no tokenizer; pass token ids instead of text")
        if not chat:
            return tok(prompt, add_special_tokens=True)["input_ids"]
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}]
        return self.encode_chat(messages)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template, ready for the reply."""
        tok = self.tokenizer
        if tok is None:
            raise AnchorspecError("this target has no tokenizer; pass token ids instead of text")
        return prompt_ids(tok, messages)

    def stop_token_ids(self) -> tuple[int, ...]:
        ids = set()
        eos = getattr(self.target.model.generation_config, "eos_token_id", None) or self.target.config.eos_token_id
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                ids.add(int(e))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def generate(self, prompt: str | list[int] | torch.Tensor, *, chat: bool = False, system: str | None = None,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, shape: TreeShape | None = None, speculative: bool = True,
                 adaptive: bool = False, depth_control: str | None = None, staged: int | None = None,
                 prune: str | None = None, lookup: LookupSettings | str | None = "default") -> Completion:
        """`depth_control`: "step" or "pid" start from the shape and adapt its depth to the acceptance
        of this generation (decode/adaptive.py); `adaptive=True` is "step". `staged=S`: the target's
        first forward covers S draft levels, the deeper ones only once the path reaches them
        (decode/engine.py). `prune="drift"`: stop expanding a draft branch whose drafter state has
        drifted (decode/propose.py). `lookup`: merge a chain copied from the sequence itself into each
        draft (decode/lookup.py; at T > 0 its tokens are fixed candidates beside the drawn ones); "default"
        is LookupSettings() unless `staged` is asked for (the two do not combine), None turns it off. On an
        engine without a drafter, a LookupSettings given makes the chain the whole draft (prompt lookup);
        "default" there decodes plainly."""
        if adaptive and depth_control not in (None, "step"):
            raise AnchorspecError(f"adaptive=True is depth_control='step'; it conflicts with {depth_control!r}")
        if lookup == "default":  # with a drafter; without one, only a lookup asked for drafts (prompt lookup)
            lookup = None if staged is not None or self.proposer is None else LookupSettings()
        elif lookup is not None and not isinstance(lookup, LookupSettings):
            raise AnchorspecError(f"lookup must be LookupSettings, 'default' or None, got {lookup!r}")
        ids = self.encode(prompt, chat, system) if isinstance(prompt, str) else prompt
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, top_p, top_k),
                               seed=seed, stop_token_ids=self.stop_token_ids())
        if speculative and self.proposer is not None:
            base = shape or self.shape_for(cfg.sampling)
            # a measured shape keeps being checked against the other candidates; a given or tuned one is kept
            measured = shape is None and self.shape_source.startswith("measured")
            self.proposer.prune = prune
            res: GenerationResult = generate_speculative(self.target, self.proposer, ids, cfg,
                                                         depth_controller("step" if adaptive else depth_control,
                                                                          base), self.monitor, staged,
                                                         self.candidate_trees(cfg.sampling) if measured else None,
                                                         lookup)
            self.remember()
        elif speculative and lookup is not None:  # no drafter: the chain copied from the text is the whole draft
            res = generate_prompt_lookup(self.target, ids, cfg, lookup)
        else:
            res = generate_vanilla(self.target, ids, cfg)
        text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Completion(text, res.token_ids, res.finish_reason, res.stats)


def load(target: str, drafter: str | None = None, dtype: str = "auto", threads: int | None = None,
         shape: TreeShape | None = None, fallback: bool = True, pack: str | None = None,
         compile: bool | str = False, remember: bool | None = None, expected_tokens: int | None = None,
         batched: bool = False) -> Engine:
    """`dtype="auto"`: bfloat16 where it is faster than float32 on this machine (see models/dtype.py).
    `pack` ("auto", "on", "off"; None: $ANCHORSPEC_PACK or auto): prepack the target's weights for
    oneDNN where the probe measured that faster (models/packed.py). `compile`: Target.compile() (its
    frozen graph packs the weights itself, so `pack` is off for the target then): on a CPU one graph
    compiled ahead of time, once per model and machine, and loaded in seconds by every later process;
    the drafter's passes likewise (a graph of their own). On CUDA torch.compile for both, every graph
    compiled before load returns (Engine.warm_up). "auto": compile on a CPU when the AOT graph for this
    target (weights, aux layers) and machine is already on disk (`anchorspec compile` writes it), or
    when the caller expects to generate at least COMPILE_PAYS_AT new tokens (`expected_tokens`), which
    repay the compile in this run (then the drafter's graph is compiled too); else as False.
    `shape=None` with a drafter: the shape `anchorspec tune` chose for this target, drafter, dtype and
    machine if it was run, else the chain the measured costs favour (`engine.shape_source` says which).
    `fallback=False`: speculate at every step, even where plain decoding would be faster.
    `remember` (None: on unless $ANCHORSPEC_REMEMBER=off): start from the step costs and acceptance
    that earlier runs of this target, drafter, dtype and machine measured, and add this run's to
    them (kept under $ANCHORSPEC_HOME/costs); off: calibrate afresh and keep nothing. `batched`: the engine will run
    rounds of several sequences (a server's scheduler), so compiled models keep a second graph where grouped
    attention's few-row form is faster (models/attention.py: graph_forms); one stream does not repay its compile."""
    if threads:
        torch.set_num_threads(threads)  # before the dtype probe and the profile look-up: both depend on it
    torch_dtype = resolve_target_dtype(dtype, target, pack=pack)  # with compile too: its frozen graph packs
    d = load_drafter(drafter, torch_dtype) if drafter else None
    aux = d.config.eagle_aux_hidden_state_layer_ids if d is not None else None
    if compile not in (True, False, "auto"):
        raise AnchorspecError(f"compile must be True, False or 'auto', got {compile!r}")
    loaded = load_target(target, torch_dtype, aux_layer_ids=aux, pack="off" if compile else pack)
    auto = compile == "auto"
    if auto:  # the AOT graph if an earlier process compiled it for this model and machine ...
        on_cpu = loaded.embed_weight.device.type == "cpu"
        compile = on_cpu and loaded.aot_path().exists()
        if on_cpu and (expected_tokens or 0) >= COMPILE_PAYS_AT:  # ... or whatever is missing, if this run repays it
            if not compile:  # (a missing drafter graph is compiled too: 13 s, its own line says so)
                print(f"anchorspec: --compile auto compiles the step graphs first: {expected_tokens} new tokens "
                      f"asked for (from {COMPILE_PAYS_AT} a run repays the compile; later runs load the graphs)",
                      file=sys.stderr)
            compile, auto = True, False
        if not compile:
            pack_if_faster(loaded.model, pack, torch_dtype)  # as load_target would have
    if compile:
        loaded.compile(batched=batched)
        if d is not None:
            # the target's way: both ahead of time on a CPU, torch.compile on CUDA
            d.compile(aot=loaded.aot, batched=batched)
    if remember is None:
        remember = switched_on("ANCHORSPEC_REMEMBER")
    costs_file, pack_drafter = None, None  # None: Engine packs the drafter as the target's weights are
    if d is not None:
        attach_drafter(loaded, d)  # binds the embedding that the drafter's graph key reads
        if auto and d.aot and not d.aot_path().exists():
            d.compile(False)  # auto compiles nothing: this drafter's passes run eager beside the target's graph,
            # whose weights show no packing (it packs inside the graph): the verdict for its dtype decides
            pack_drafter = resolve_packing(pack, torch_dtype, loaded.embed_weight.device, model_shapes(loaded.config),
                                           announce=False)
        if remember:
            variant = ("aot" if loaded.aot else "compiled") if compile else "packed" if is_packed(loaded.model) else "eager"
            costs_file = costs_path(resolve_target(target), drafter, torch_dtype, variant)
    engine = Engine(loaded, d, shape, fallback, costs_file, pack_drafter)
    if compile:
        engine.warm_up()  # every graph now, none in the middle of a generation
    if d is not None and shape is None:
        from .decode.shape import load_profile_shape

        tuned = load_profile_shape(resolve_target(target), drafter, torch_dtype)
        if tuned is not None:
            engine.shape, engine.shape_source = tuned[0], f"tuned ({tuned[1]})"
    return engine
