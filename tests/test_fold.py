"""benchmarks/fold_eagle31_to_eagle3.py: folding EAGLE-3.1's per-state fc_norm into fc is exact where each
captured state's RMS is the same on every row, and only approximate where it varies (the fold is a start
point for EAGLE-3 training, never a conversion); the least-squares fold is the better of the two there."""

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fold_eagle31_to_eagle3 import diagonal_fold, fold_error, least_squares_fold  # noqa: E402

from anchorspec.models.drafter import init_drafter


def drafter_31(seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2)
    d = init_drafter(cfg, "eagle3.1", draft_vocab_size=32, seed=seed, init_std=0.2).to(torch.float64)
    with torch.no_grad():
        for norm in d.fc_norm:
            norm.weight.uniform_(0.5, 2.0)
    return d


def rows_with_rms(n: int, rms_per_chunk, width: int, seed: int) -> torch.Tensor:
    """n random rows whose chunk j has RMS rms_per_chunk[j] (a number, or [n] per row)."""
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for rms in rms_per_chunk:
        c = torch.randn(n, width, generator=g, dtype=torch.float64)
        scale = torch.as_tensor(rms, dtype=torch.float64).reshape(-1, 1)
        chunks.append(c / c.pow(2).mean(-1, keepdim=True).sqrt() * scale)
    return torch.cat(chunks, dim=-1)


def rel_err(d, w, x):
    return fold_error(d, w, x)["rel_err"]


def test_fold_is_exact_where_each_state_has_one_rms():
    d = drafter_31()
    H = d.config.target_hidden_size
    x = rows_with_rms(400, [0.7, 3.0, 20.0], H, seed=1)
    fresh = rows_with_rms(50, [0.7, 3.0, 20.0], H, seed=2)
    assert rel_err(d, least_squares_fold(d, x, ridge=0.0), fresh) < 1e-9
    assert rel_err(d, diagonal_fold(d, x), fresh) < 1e-5  # the RMSNorm's eps, nothing else
    assert rel_err(d, least_squares_fold(d, x), fresh) < 1e-3  # the default ridge's bias


def test_fold_is_approximate_where_the_rms_varies_and_least_squares_fits_better():
    d = drafter_31()
    H = d.config.target_hidden_size
    g = torch.Generator().manual_seed(3)
    spread = [s * torch.exp(0.4 * torch.randn(600, generator=g, dtype=torch.float64)) for s in (0.7, 3.0, 20.0)]
    x = rows_with_rms(600, spread, H, seed=4)
    ls, diag = rel_err(d, least_squares_fold(d, x), x), rel_err(d, diagonal_fold(d, x), x)
    assert ls > 0.1  # no linear map reproduces a per-row division
    assert ls < diag
