"""anchorspec: EAGLE-3/3.1 speculative decoding for Hugging Face causal LMs.

Data path: models/ (target with aux capture, drafter) -> decode/ (propose -> verify -> commit)
-> metrics. The math lives in pure functions (decode/sampling.py, decode/verify.py, decode/tree.py).
"""

from .api import Completion, Engine, attach_drafter, load
from .decode.sampling import SamplingParams
from .decode.tree import TreeShape
from .errors import AnchorspecError

__all__ = ["AnchorspecError", "Completion", "Engine", "SamplingParams", "TreeShape", "attach_drafter", "load"]
__version__ = "0.1.0"
