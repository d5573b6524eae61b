"""Session 81: a chain of 2 calibrated by the scheduler on dummy prompts of 16 and of 256 tokens (twice each), at 4 and 16
rows: how much a 16-token calibration underprices a round of real contexts. bf16, 1 thread, AOT graphs. Run from the repo root."""
import sys, time, torch
from contextlib import contextmanager
from anchorspec.api import load
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, PlainDecoding
from anchorspec.decode.fallback import DriftMonitor
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.tree import TreeShape
from anchorspec.serve import scheduler as sm
torch.set_num_threads(1)
engine = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", "auto", threads=1, compile="auto")
for ctx in (16, 256, 16, 256):
    class S(sm.Scheduler):
        @contextmanager
        def _dummy_batch(self, rows, cfg, plain=False):
            target = self.engine.target
            prompt = [(i * 7 + r) % 5000 + 100 for r in range(1) for i in range(ctx)]
            decs = [PlainDecoding(target, prompt, cfg) if plain else SpeculativeDecoding(target, EagleProposer(self.engine.drafter), prompt, cfg, self.shape) for _ in range(rows)]
            decoder = BatchDecoder(target)
            try:
                yield decoder, decs
            finally:
                for d in decs: decoder.release(d)
    m = DriftMonitor(smoothing=1.0)
    s = S(engine, monitor=m, shape=TreeShape.chain(2), max_running=16, calibrate=False)
    s.calibrate(batches=(4, 16))
    print(ctx, " ".join(f"B{b}: plain {1e3*m.forward(b,1):.1f} verify {1e3*m.forward(b,m.width):.1f} draft {1e3*m.drafting(b):.1f} t* {m.threshold_at(b):.2f}" for b in (4, 16)), flush=True)
