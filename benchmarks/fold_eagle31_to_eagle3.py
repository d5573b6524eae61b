"""An EAGLE-3 start point from an EAGLE-3.1 drafter: the 3.1 weights with its per-state fc_norm folded into fc.

Why: the EAGLE-3 variant is the one llama.cpp can run, and it has trained on 5x fewer token-steps than the
EAGLE-3.1 release. The two differ only in fc_norm (an RMSNorm per captured state before fc) and norm_output
(norm(h) rather than h fed to the next draft step), so 3.1's weights are a candidate initialisation for
EAGLE-3 training. Neither difference is exactly expressible (an RMSNorm divides by a per-token RMS), so
this is a start point to train from, never a conversion.

fc_norm is replaced by the linear map that best reproduces 3.1's fused context features
fc(concat(fc_norm_j(a_j))) from the raw states concat(a_j): least squares over target features of training
conversations (the held-out split of `train --seed 0 --heldout 0.02` is left out; position 0, a sink
token with outsized activations, is left out of the fit and reported apart). A diagonal fold
(w_j / median RMS of a_j per chunk) is reported beside it. norm_output has no fold; training adapts.

    python benchmarks/fold_eagle31_to_eagle3.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        --data corpus/smollm2-135m-instruct --out $ANCHORSPEC_HOME/runs/smollm2-135m-instruct/eagle3-from31
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from anchorspec.atomic import atomic_write_text
from anchorspec.data.corpus import read_corpus
from anchorspec.models.drafter import load_drafter, save_drafter
from anchorspec.models.target import load_target
from anchorspec.train.dataset import split_heldout


@torch.no_grad()
def least_squares_fold(d31, x: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """The fc weight W [H, n_aux*Ht] minimising |x W^T - fc(concat(fc_norm_j(x_j)))|^2 over the rows of x, with a
    small ridge (the captured states are far from independent): W^T = (x^T x + r I)^-1 x^T y."""
    x = x.double()
    y = d31.project_features(x).double()
    gram = x.T @ x
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + ridge * gram.diagonal().mean() * eye, x.T @ y).T


def median_rms(d31, x: torch.Tensor) -> list[torch.Tensor]:
    """Each captured state's (chunk's) median RMS over the rows of x."""
    return [c.double().pow(2).mean(-1).sqrt().median() for c in x.split(d31.config.target_hidden_size, dim=-1)]


@torch.no_grad()
def diagonal_fold(d31, x: torch.Tensor) -> torch.Tensor:
    """fc with each chunk's columns scaled by that chunk's norm weight over the chunk's median RMS in x."""
    scale = [norm.weight.double() / rms for norm, rms in zip(d31.fc_norm, median_rms(d31, x))]
    return d31.fc.weight.double() * torch.cat(scale)[None, :]


@torch.no_grad()
def fold_error(d31, w: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """Relative error of the fused features x W^T against 3.1's, and their mean cosine (q/k/v read them through
    hidden_norm, which sees only the direction; the residual sees the scale too)."""
    y, y_hat = d31.project_features(x), x @ w.T
    return {"rel_err": float((y_hat - y).norm() / y.norm()),
            "cosine": float(torch.nn.functional.cosine_similarity(y_hat, y, dim=-1).mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True, help="an EAGLE-3.1 drafter (fc_norm on)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True, help="a packed corpus folder")
    ap.add_argument("--fit", type=int, default=96, help="training conversations to fit on")
    ap.add_argument("--check", type=int, default=32, help="other training conversations to measure the fit on")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="where the EAGLE-3 start point is written")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()

    d31 = load_drafter(a.drafter, torch.float64)
    if d31.fc_norm is None:
        print(f"{a.drafter}: not an EAGLE-3.1 drafter (fc_norm off): nothing to fold", file=sys.stderr)
        return 2
    target = load_target(a.target, dtype=torch.float32, pack="off",
                         aux_layer_ids=d31.config.eagle_aux_hidden_state_layer_ids)
    examples = read_corpus(a.data, vocab_size=target.model.config.vocab_size)
    train_idx, _held = split_heldout([e.input_ids for e in examples], 0.02, 0, minimum=2)
    pick = random.Random(0).sample(train_idx, a.fit + a.check)

    def features(indices):
        """Raw aux states [N, n_aux*H] (float64) of positions >= 1, and position 0's apart."""
        rest, first = [], []
        for i in indices:
            ids = torch.tensor([examples[i].input_ids[: a.max_len]])
            with torch.no_grad():
                aux = target.features(ids, torch.ones_like(ids)).aux[0].double()
            first.append(aux[:1])
            rest.append(aux[1:])
        return torch.cat(rest), torch.cat(first)

    x_fit, _ = features(pick[: a.fit])
    x_chk, x_first = features(pick[a.fit:])
    w_ls, w_diag = least_squares_fold(d31, x_fit), diagonal_fold(d31, x_fit)
    report = {
        "drafter": a.drafter, "fit_positions": int(x_fit.shape[0]), "check_positions": int(x_chk.shape[0]),
        "fold_error": {
            name: {"fit": fold_error(d31, w, x_fit), "check": fold_error(d31, w, x_chk),
                   "position0": fold_error(d31, w, x_first)}
            for name, w in (("least_squares", w_ls), ("diagonal", w_diag))
        },
        "median_rms_per_chunk": [float(r) for r in median_rms(d31, x_fit)],
    }
    # the 3.1 drafter itself becomes the EAGLE-3 start: the fitted fc, no fc_norm, the raw state fed back
    d3 = d31.to(torch.float32)
    with torch.no_grad():
        d3.fc.weight.copy_(w_ls.float())
    d3.fc_norm = None
    d3.config.fc_norm = False
    d3.config.norm_output = False
    save_drafter(d3, a.out, dtype=torch.bfloat16)
    report["seconds"] = round(time.time() - t0, 1)
    atomic_write_text(Path(a.out) / "fold.json", json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
