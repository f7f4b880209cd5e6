"""The surfaces bench/fuzz.py mutates, one module each, and the case runner they share (cases.py)."""
