"""Session 84: does the calibration's plain step (measured right after its widest verify, 3 samples) read high?
verify_cost's plain step alone (no other sizes) against within the calibration's sizes, alternating, 6 times each."""
import statistics, time
import torch
from anchorspec.api import load
from anchorspec.decode.fallback import CALIBRATED_SIZES
from anchorspec.decode.shape import verify_cost

torch.set_num_threads(2)
eng = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", "auto", threads=2, remember=False,
           compile=True)
print("sizes", CALIBRATED_SIZES)
alone, mixed = [], []
for i in range(6):
    _, p = verify_cost(eng.target, 128, [], repeats=3); alone.append(p)
    _, p = verify_cost(eng.target, 128, list(CALIBRATED_SIZES), repeats=3); mixed.append(p)
print("plain step alone (ms):", [round(1e3 * x, 2) for x in alone], "median", round(1e3 * statistics.median(alone), 2))
print("plain step in the calibration's mix (ms):", [round(1e3 * x, 2) for x in mixed], "median", round(1e3 * statistics.median(mixed), 2))
