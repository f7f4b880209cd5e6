"""Hostile device profiles for `colibri-sdk build`."""

from __future__ import annotations

import time

import pytest
from colibri_sdk.errors import ProfileError
from colibri_sdk.profile import load_profile, packaged_dir
from robustness_helpers import cli_error

ORIN = (packaged_dir() / "orin.yaml").read_text()


def _alias_bomb() -> str:
    """A YAML value of 9**9 (387 million) leaves made of nine nested aliases: tiny to parse, huge to print."""
    value = "&a1 [l, l, l, l, l, l, l, l, l]"
    for i in range(2, 10):
        value = f"&a{i} [{value}" + f", *a{i - 1}" * 8 + "]"
    return value


def _profile(tmp_path, text: str):
    path = tmp_path / "board.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("key", ["name: jetson-agx-orin-64gb", "sm_count: 16"])
def test_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path, key):
    path = _profile(tmp_path, ORIN.replace(key, key.split(":")[0] + ": " + _alias_bomb()))
    start = time.perf_counter()
    with pytest.raises(ProfileError, match=r"(name|hardware\.sm_count) = \[\[\[\[\.\.\.\], .*\(list\); allowed: "):
        load_profile(path, toolchain=False)
    assert time.perf_counter() - start < 5
    with pytest.raises(ProfileError) as info:
        load_profile(path, toolchain=False)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("sm_count: 16", "sm_count: " + "9" * 5000), r"not valid YAML: Exceeds the limit \(4300 digits\)"),
        (("allow_spills: false", "allow_spills: false\n? [a, b]\n: 1"), r"the key at line \d+ is a list; allowed: a plain scalar key"),
        (("allow_spills: false", "allow_spills: false\n{[1]: 2}: 3"), r"the key at line \d+ is a (list|dict); allowed: a plain scalar key"),
        (("description: NVIDIA", "description: " + "[" * 10000 + "]" * 10000 + "\nx: NVIDIA"), r"not valid YAML: nested too deeply"),
        (("arch: sm_87", "arch: sm_8\uff17"), r"target\.arch = 'sm_8\uff17'; allowed: sm_XY"),  # a full-width digit
        (("arch: sm_87", "arch: sm_087"), r"target\.arch = 'sm_087'; allowed: sm_XY"),
        (("arch: sm_87", "arch: sm_87a"), r"target\.arch = 'sm_87a'; allowed: sm_XY"),
        (("arch: sm_87", "arch: 87"), r"target\.arch = 87 \(int\); allowed: str"),
        (("name: jetson-agx-orin-64gb", "name: !!python/object/apply:os.system ['false']"),
         r"could not determine a constructor for the tag 'tag:yaml\.org,2002:python/object/apply:os\.system'"),
    ],
    ids=["int-of-5000-digits", "list-key", "flow-list-key", "nested-10000-deep", "fullwidth-digit-arch",
         "leading-zero-arch", "feature-suffix-arch", "int-arch", "python-tag"],
)
def test_profile_that_breaks_the_parser_or_the_arch_pattern(tmp_path, edit, message):
    old, new = edit
    assert old in ORIN
    with pytest.raises(ProfileError, match=message):
        load_profile(_profile(tmp_path, ORIN.replace(old, new, 1)), toolchain=False)


def test_profile_path_that_is_not_a_regular_file(tmp_path, capsys):
    """A FIFO (reading it would wait for a writer) and /dev/zero (it never ends) are refused as what they are."""
    import os

    fifo = tmp_path / "board.yaml"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        err = cli_error(capsys, "build", "--profile", str(path), "--demo", "-o", str(tmp_path / "out"))
        assert err.endswith(f"profile '{path}' is not a regular file; allowed: a .yaml file or a shipped profile name")
    assert not (tmp_path / "out").exists()


def test_profile_path_that_is_a_folder(tmp_path, capsys):
    folder = tmp_path / "board.yaml"
    folder.mkdir()
    err = cli_error(capsys, "build", "--profile", str(folder), "--demo", "-o", str(tmp_path / "out"))
    assert err.endswith("board.yaml' is a folder; allowed: a .yaml file or a shipped profile name")
    assert not (tmp_path / "out").exists()
