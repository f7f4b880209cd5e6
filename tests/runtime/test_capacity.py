"""Expert capacity (colibri_sdk.capacity): the drop rule by hand, the reference engine and the CPU backend with
the same semantics, padding excluded, the profile keys and build flags."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from runtime_bundles import write_manifest

from colibri_sdk.capacity import NO_EXPERT, Capacity, apply_capacity
from colibri_sdk.errors import ProfileError
from colibri_sdk.format import Header, write_model
from colibri_sdk.profile import Profile, load_profile
from colibri_sdk.reference import ReferenceEngine
from colibri_sdk.runtime import Runtime

X = NO_EXPERT
# 5 tokens, top-2, 3 experts: expert 0 is every token's first choice.
IDS = np.array([[0, 1], [0, 2], [0, 1], [0, 2], [0, 1]])
W = np.array([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3], [0.8, 0.2], [0.55, 0.45]])


def test_the_rule_by_hand():
    # C = ceil(5 * 2 * 0.6 / 3) = 2 pairs per expert.
    assert Capacity(0.6).limit(5, 2, 3) == 2
    hard_score, n = apply_capacity(IDS, W, 3, Capacity(0.6, "hard", "score"))
    # Expert 0 keeps its two largest weights (tokens 1: 0.9, 3: 0.8); expert 1 (tokens 0, 2, 4: 0.4, 0.3, 0.45)
    # keeps tokens 4 and 0; expert 2 (tokens 1, 3) fits.
    assert hard_score.tolist() == [[X, 1], [0, 2], [X, X], [0, 2], [X, 1]] and n == 4
    hard_pos, n = apply_capacity(IDS, W, 3, Capacity(0.6, "hard", "position"))
    assert hard_pos.tolist() == [[0, 1], [0, 2], [X, 1], [X, 2], [X, X]] and n == 4
    # Soft: beyond C, first choices (slot 0) stay, up to 2C = 4 pairs: expert 0 keeps 1, 3, then 2, 0 (by weight);
    # token 4's first choice is the fifth and is dropped; expert 1 is nobody's first choice: as hard.
    soft, n = apply_capacity(IDS, W, 3, Capacity(0.6, "soft", "score"))
    assert soft.tolist() == [[0, 1], [0, 2], [0, X], [0, 2], [X, 1]] and n == 2
    # Padding rows take no capacity and are not counted: tokens 3, 4 are padding → T = 3, C = 2.
    padded, n = apply_capacity(IDS, W, 3, Capacity(0.6, "hard", "position"), np.array([1, 1, 1, 0, 0], bool))
    assert padded.tolist() == [[0, 1], [0, 2], [X, 1], [X, X], [X, X]] and n == 1
    ties, _ = apply_capacity(np.array([[0], [0], [0]]), np.array([[0.5], [0.5], [0.5]]), 2, Capacity(1.0))
    assert ties.tolist() == [[0], [0], [X]], "equal weights: the lower token index first"


# 4 tokens, top-2, 3 experts; weights as softmax over all experts without renormalisation over the k, so a second
# choice (token 3's 0.38 for expert 1) can outweigh another token's first choice (token 1's 0.3).
IDS2 = np.array([[0, 1], [1, 0], [1, 2], [2, 1]])
W2 = np.array([[0.5, 0.35], [0.3, 0.25], [0.6, 0.3], [0.4, 0.38]])
# Expert 0: (t0, slot 0, 0.5), (t1, slot 1, 0.25). Expert 1: (t0, 1, 0.35), (t1, 0, 0.3), (t2, 0, 0.6), (t3, 1, 0.38).
# Expert 2: (t2, 1, 0.3), (t3, 0, 0.4).


def test_min_capacity_by_hand():
    # ceil(4 * 2 * 0.3 / 3) = ceil(0.8) = 1; min_capacity 2 raises it to 2; it does not lower a larger C (8).
    assert Capacity(0.3).limit(4, 2, 3) == 1
    assert Capacity(0.3, min_capacity=2).limit(4, 2, 3) == 2
    assert Capacity(3.0, min_capacity=2).limit(4, 2, 3) == 8
    assert Capacity(0.3, min_capacity=2).limit(0, 2, 3) == 0, "no tokens: no capacity"
    # C = 2, hard, score: expert 1 keeps 0.6 (t2) and 0.38 (t3), drops t0's 0.35 and t1's 0.3; experts 0, 2 fit.
    kept, n = apply_capacity(IDS2, W2, 3, Capacity(0.3, "hard", "score", min_capacity=2))
    assert kept.tolist() == [[0, X], [X, 0], [1, 2], [2, 1]] and n == 2


def test_first_choices_first_by_hand():
    # C = 1 (factor 0.3), hard, position. By the policy alone each expert keeps its lowest token: expert 0 t0,
    # expert 1 t0 (a second choice), expert 2 t2 (a second choice).
    kept, n = apply_capacity(IDS2, W2, 3, Capacity(0.3, "hard", "position"))
    assert kept.tolist() == [[0, 1], [X, X], [X, 2], [X, X]] and n == 5
    # First choices first: expert 1's first choices (t1, t2) come before its second choices (t0, t3), lowest token
    # first: t1; expert 2 keeps t3 (its only first choice) over t2.
    kept, n = apply_capacity(IDS2, W2, 3, Capacity(0.3, "hard", "position", order="choice"))
    assert kept.tolist() == [[0, X], [1, X], [X, X], [2, X]] and n == 5
    # C = 2, hard, score, first choices first: expert 1 keeps its two first choices t2 (0.6), t1 (0.3), and drops
    # the second choices t3 (0.38) and t0 (0.35) although they outweigh t1's first choice.
    kept, n = apply_capacity(IDS2, W2, 3, Capacity(0.3, "hard", "score", min_capacity=2, order="choice"))
    assert kept.tolist() == [[0, X], [1, 0], [1, 2], [2, X]] and n == 2


def test_first_choices_first_in_soft_mode_by_hand():
    # C = 2, soft, score. By the policy alone expert 1's order is t2 (0.6), t3 (0.38), t0 (0.35), t1 (0.3): the first
    # C are t2, t3; beyond them first choices stay, up to C more: t1 (slot 0) stays, t0 (slot 1) is dropped.
    kept, n = apply_capacity(IDS2, W2, 3, Capacity(0.3, "soft", "score", min_capacity=2))
    assert kept.tolist() == [[0, X], [1, 0], [1, 2], [2, 1]] and n == 1
    # First choices first: the order is t2, t1 (slot 0), then t3, t0 (slot 1); the first C = 2 are both first
    # choices and no first choice is left beyond them: t3 and t0 are dropped.
    kept, n = apply_capacity(IDS2, W2, 3, Capacity(0.3, "soft", "score", min_capacity=2, order="choice"))
    assert kept.tolist() == [[0, X], [1, 0], [1, 2], [2, X]] and n == 2
    # C = 1, soft, first choices first: expert 1 has 2 >= C first choices and keeps min(2, 2C) = 2 of them (t2, t1)
    # and no second choice; expert 0 keeps t0 (slot 0) and drops t1 (slot 1); expert 2 keeps t3, drops t2.
    kept, n = apply_capacity(IDS2, W2, 3, Capacity(0.3, "soft", "score", order="choice"))
    assert kept.tolist() == [[0, X], [1, X], [1, X], [2, X]] and n == 4


def skewed_bundle(folder: Path, capacity: dict | None, composition: int = 1):
    """3 layers, 6 experts, top-2, hidden 64; the router favours experts 0 and 1 (skewed routing)."""
    from runtime_bundles import write_bundle

    rng = np.random.default_rng(8)
    L, E, H, I = 3, 6, 64, 32
    router = rng.standard_normal((L, H, E))
    router[:, :, :2] += 0.6
    header = Header(num_layers=L, num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=0, routing=0,
                    composition=composition)
    path = write_model(folder / "m.colibri", header, rng.standard_normal((L, E, I, H)) / 8,
                       rng.standard_normal((L, E, I, H)) / 8, rng.standard_normal((L, E, H, I)) / 6, router)
    bundle = write_bundle(folder / "bundle", path, 2, 8)
    if capacity is not None:
        manifest = json.loads((bundle / "manifest.json").read_text())
        manifest["profile"]["capacity"] = capacity
        write_manifest(bundle, manifest)
    return bundle, path


@pytest.mark.parametrize("mode,policy,extra", [("hard", "score", {}), ("soft", "position", {}),
                                               ("hard", "position", {"min_capacity": 4, "order": "choice"}),
                                               ("soft", "position", {"order": "choice"})])
def test_cpu_backend_equals_the_reference_with_capacity(tmp_path, mode, policy, extra):
    spec = {"factor": 1.0, "mode": mode, "policy": policy, **extra}
    bundle, path = skewed_bundle(tmp_path, spec)
    x = np.random.default_rng(3).standard_normal((2, 8, 64)).astype(np.float32)
    engine = ReferenceEngine(path, compute_dtype=np.float64, capacity=Capacity.from_dict(spec))
    expected = engine(x)
    expected_dropped = engine.dropped
    dropless = ReferenceEngine(path, compute_dtype=np.float64)(x)
    with Runtime.load(bundle, backend="cpu") as rt:
        y = rt.infer(x)
        stats = rt.stats()
        assert rt.self_test().passed, "the self-test runs dropless"
        # Padding takes no capacity: 5 valid tokens of sequence 0 only equal the reference on those 5 tokens.
        short = rt.infer(x[:1, :5])
    assert expected_dropped > 0 and not np.allclose(expected, dropless, atol=1e-3)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert stats.last_dropped_pairs == expected_dropped == stats.dropped_pairs
    np.testing.assert_allclose(short, engine(x[:1, :5]), rtol=1e-5, atol=1e-5)
    if extra:  # the options change what is dropped (so the backend read them from the manifest)
        base = ReferenceEngine(path, compute_dtype=np.float64, capacity=Capacity(1.0, mode, policy))
        assert not (np.allclose(base(x), y, atol=1e-3) and np.allclose(base(x[:1, :5]), short, atol=1e-3))


def test_a_self_test_in_another_thread_leaves_capacity_on(tmp_path):
    """self_test runs dropless for its own call only: infer calls of another thread meanwhile keep the bundle's
    capacity (a flag set outside the lock had sent them dropless: a silent wrong answer)."""
    import threading

    bundle, _ = skewed_bundle(tmp_path, {"factor": 1.0, "mode": "hard", "policy": "score"})
    x = np.random.default_rng(3).standard_normal((2, 8, 64)).astype(np.float32)
    with Runtime.load(bundle, backend="cpu") as rt:
        expected = rt.infer(x)
        assert rt.stats().last_dropped_pairs > 0
        stop, passed = threading.Event(), []

        def self_tests():
            while not stop.is_set():
                passed.append(rt.self_test().passed)

        worker = threading.Thread(target=self_tests)
        worker.start()
        try:
            wrong = sum(not np.array_equal(rt.infer(x), expected) for _ in range(40))
        finally:
            stop.set()
            worker.join()
    assert passed and all(passed)
    assert wrong == 0, f"{wrong} of 40 calls ran without expert capacity"


def test_a_token_with_every_pair_dropped_passes_through(tmp_path):
    bundle, _ = skewed_bundle(tmp_path, {"factor": 0.05, "mode": "hard", "policy": "position"})  # C = 1
    x = np.random.default_rng(4).standard_normal((2, 8, 64)).astype(np.float32)
    with Runtime.load(bundle, backend="cpu") as rt:
        y = rt.layer(0, x)
    # Residual composition; with C = 1 and 6 experts at most 6 pairs are kept: most tokens pass through unchanged.
    unchanged = np.all(y == x, axis=-1)
    assert 10 <= int(unchanged.sum()) < 16


def test_profile_keys_and_build_flags(capsys, tmp_path):
    data = copy.deepcopy(load_profile("orin", toolchain=False).data)
    data["capacity"] = {"factor": 1.25, "mode": "soft", "policy": "position"}
    assert Profile.from_dict(data, "p.yaml", toolchain=False).data["capacity"]["mode"] == "soft"
    for bad, message in [
        ({"factor": 0}, "p.yaml: capacity.factor = 0; allowed: a number in (0, 64]"),
        ({"factor": 1, "mode": "firm"}, "p.yaml: capacity.mode = 'firm'; allowed: hard, soft"),
        ({"factor": 1, "policy": "random"}, "p.yaml: capacity.policy = 'random'; allowed: score, position"),
        ({"factor": 1, "size": 3},
         "p.yaml: capacity: unknown keys ['size']; allowed: factor, mode, policy, min_capacity, order"),
        ({"factor": 1, "min_capacity": 0}, "p.yaml: capacity.min_capacity = 0; allowed: an integer in 1..1048576"),
        ({"factor": 1, "min_capacity": 2.5},
         "p.yaml: capacity.min_capacity = 2.5; allowed: an integer in 1..1048576"),
        ({"factor": 1, "min_capacity": True},
         "p.yaml: capacity.min_capacity = True; allowed: an integer in 1..1048576"),
        ({"factor": 1, "min_capacity": 1 << 21},
         "p.yaml: capacity.min_capacity = 2097152; allowed: an integer in 1..1048576"),
        ({"factor": 1, "order": "slot"}, "p.yaml: capacity.order = 'slot'; allowed: policy, choice"),
    ]:
        data["capacity"] = bad
        with pytest.raises(ProfileError) as info:
            Profile.from_dict(data, "p.yaml", toolchain=False)
        assert str(info.value) == message
    from colibri_sdk.cli import main

    assert main(["build", "--profile", "orin", "--demo", "--capacity-mode", "soft", "-o", str(tmp_path / "b")]) == 1
    assert "--capacity-mode / --capacity-policy / --capacity-min / --capacity-order need --capacity-factor F" in (
        capsys.readouterr().err)
    assert main(["build", "--profile", "orin", "--demo", "--capacity-min", "4", "-o", str(tmp_path / "b")]) == 1
    assert "need --capacity-factor F" in capsys.readouterr().err
    # A bad value from the command line: one line naming the flag and the value.
    assert main(["build", "--profile", "orin", "--demo", "--capacity-factor", "1", "--capacity-min", "0",
                 "-o", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "--capacity-min 0" in err and "capacity.min_capacity = 0; allowed: an integer in 1..1048576" in err
    assert len(err.strip().splitlines()) == 1
    for argv, word in ((["--capacity-min", "two"], "'two'"), (["--capacity-order", "slot"], "'slot'")):
        with pytest.raises(SystemExit) as exit_info:
            main(["build", "--profile", "orin", "--demo", "--capacity-factor", "1", *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert word in err and argv[0] in err  # argparse's usage error names the flag and the value


def test_old_capacity_mappings_keep_their_form():
    """A mapping without the new keys reads as before: min_capacity 1, order policy, the same to_dict, kernel
    constants and launch flags."""
    from colibri_sdk import catalog

    old = {"factor": 0.6, "mode": "soft", "policy": "position"}
    cap = Capacity.from_dict(old)
    assert (cap.min_capacity, cap.order) == (1, "policy") and cap.to_dict() == old
    assert "COLI_CAPACITY_MIN" not in catalog.capacity_defines(old) and catalog.capacity_flags(old) == 3
    new = dict(old, min_capacity=8, order="choice")
    assert Capacity.from_dict(new).to_dict() == new
    assert catalog.capacity_defines(new)["COLI_CAPACITY_MIN"] == 8 and catalog.capacity_flags(new) == 7
