"""User-facing errors: one line that names the problem and the values involved."""


class AnchorspecError(Exception):
    """Raised for bad input (files, shapes, vocabularies, flags). The CLI prints it as one line."""
