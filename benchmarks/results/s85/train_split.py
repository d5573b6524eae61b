"""Where a CPU training step's time goes: the target's feature pass (`Trainer._batch`) against the drafter's TTT
forward + backward and the optimizer step, over N steps of a continued round on one corpus part.
    COMPILE_LOSS=1 python benchmarks/results/s85/train_split.py [--steps 12] [--threads 2] [--dtype bfloat16] \
        [--part 0067]
COMPILE_LOSS=1: the compiled loss kernels `train` runs by default (unset: eager); PROFILE=1 adds a torch profile of 3
more steps by op, SHAPES=1 by op and input shape."""
import argparse
import os
import statistics
import tempfile
import time

import torch

from anchorspec.train.trainer import Trainer, TrainConfig, _Accum

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--part", default="0067")
ap.add_argument("--batch-tokens", type=int, default=2048)
a = ap.parse_args()
torch.set_num_threads(a.threads)
out = tempfile.mkdtemp()
cfg = TrainConfig(target="smollm2-135m-instruct", data=[f"corpus/smollm2-135m-instruct:{a.part}"], out=out,
                  variant="eagle3.1", ttt_steps=4, init_from="checkpoints/smollm2-135m-instruct-eagle3.1",
                  max_len=1024, max_steps=a.steps + 2, lr=1e-4, warmup_ratio=0.03, batch_tokens=a.batch_tokens,
                  dtype=a.dtype, heldout=0.02, eval_every=100000, save_every=100000, eval_prompts=0, eval_replay=0,
                  eval_heldout=8, progress=False, compile_loss=bool(os.environ.get("COMPILE_LOSS")),
                  draft_vocab_size=8192)
tr = Trainer(cfg)
feat_t = []
orig = tr._batch
def timed(indices):
    t = time.perf_counter(); b = orig(indices); feat_t.append(time.perf_counter() - t); return b
tr._batch = timed
w = _Accum()
steps = []
for i in range(a.steps):
    t = time.perf_counter(); _, tok = tr.train_step(w); steps.append((time.perf_counter() - t, tok))
feat = statistics.median(feat_t[2:]); step = statistics.median(s for s, _ in steps[2:])
tok = statistics.median(t for _, t in steps[2:])
print(f"torch {torch.__version__}, {a.threads} threads, dtype {a.dtype}, batch_tokens {a.batch_tokens}")
print(f"step {step:.3f} s median ({tok} tokens: {tok/step:.0f} token-steps/s); target features {feat:.3f} s "
      f"({feat/step:.0%}); drafter TTT fwd+bwd+opt {step-feat:.3f} s")
if os.environ.get("PROFILE"):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(3):
            tr.train_step(w)
    table = prof.key_averages(group_by_input_shape=bool(os.environ.get("SHAPES")))
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=30,
                      max_shapes_column_width=70))
