"""prompt -> draft (propose) -> verify -> commit: one module per step, math kept in pure functions."""
