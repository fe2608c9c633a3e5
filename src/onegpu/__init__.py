"""onegpu: train transformer language models efficiently on one GPU (or a CPU)."""

__version__ = "0.1.0"
