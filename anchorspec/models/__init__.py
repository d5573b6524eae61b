"""Model loading: the HF target (with aux-state capture) and the EAGLE-3/3.1 drafter."""
