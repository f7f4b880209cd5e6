"""A bundle of a random one-layer v2 `.colibri` file, shared by tests that read bundles of v2 weights."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np


def random_v2_bundle(root: Path, header, seed: int, name: str = "v2"):
    """Write `root/NAME.colibri` for `header` (a HeaderV2 of one layer; every array N(0, 0.3²) from `seed`) and
    build it for the orin profile at batch 1 x tokens 2 into `root/bundle`. Returns the built bundle's path."""
    from colibri_sdk.bundle.writer import build_bundle
    from colibri_sdk.format import write_arrays
    from colibri_sdk.profile import Profile, load_profile

    rng = np.random.default_rng(seed)
    arrays = {k: 0.3 * rng.standard_normal(((1, header.count(k)) if header.is_matrix(k) else (1,)) + header.shape(k))
              for k in header.kinds}
    weights = write_arrays(root / f"{name}.colibri", header, arrays)
    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["shape"] = {"batch": 1, "tokens": 2}
    return build_bundle(Profile.from_dict(data), root / "bundle", weights, workers=2).path
