"""Fixtures for tests/convert: saved checkpoints of tiny random-init transformers MoE models."""

from __future__ import annotations

import shutil

import pytest

from hf_models import make_model


@pytest.fixture(scope="session")
def saved_mixtral(tmp_path_factory):
    """A saved Mixtral checkpoint (per-expert layout, fp32, top-2, 16 experts) and its model; read-only: copy it."""
    model = make_model("mixtral", 2)
    folder = tmp_path_factory.mktemp("ckpt") / "mixtral"
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture
def mixtral_copy(saved_mixtral, tmp_path):
    folder = tmp_path / "mixtral"
    shutil.copytree(saved_mixtral[0], folder)
    return folder
