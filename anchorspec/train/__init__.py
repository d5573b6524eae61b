"""Training: draft vocabulary, TTT trainer (data -> features -> train)."""
