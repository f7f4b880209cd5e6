"""Helpers for the kernel tests."""

from __future__ import annotations

from colibri_sdk.format import Header


def make_header(hidden=256, inter=512, experts=8, top_k=2, dtype="fp16", routing=0, composition=1, layers=1):
    """A .colibri header with the given sizes (the weights themselves are not needed to compile or plan)."""
    return Header(layers, experts, top_k, hidden, inter, dtype=1 if dtype == "fp16" else 0, routing=routing,
                  composition=composition)
