"""A damaged checkpoint is never resumed: bytes flipped inside every kind of checkpoint file
(size unchanged), a tensor renamed or removed from a block file, an edited manifest: each is
refused with a CheckpointError naming the file and saying to pass --restart; the CLI turns
it into exit code 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nmprune.checkpoint import MANIFEST, Checkpoint, CheckpointError, content_sha256, file_sha256
from nmprune.config import PruneSettings
from nmprune.output import MARKER
from nmprune.pipeline import prune_model
from test_models_tiny import tiny_model, token_batch
from test_pipeline import fail_after, Stop

SETTINGS = PruneSettings(method="magnitude", refine=None, hessian_inputs="pruned", batch_size=2)
IDS = token_batch(4, 12)


@pytest.fixture(scope="module")
def partial_checkpoint(tmp_path_factory):
    """A checkpoint with blocks 0 and 1 of 3 finished: block_0000, block_0001, hidden_0001."""
    d = tmp_path_factory.mktemp("ck") / "ck"
    with pytest.raises(Stop):
        prune_model(tiny_model("llama", layers=3), settings=SETTINGS, calibration=IDS, progress=False,
                    checkpoint=Checkpoint.open(d, "id"), on_block_done=fail_after(1))
    assert sorted(p.name for p in d.iterdir()) == [
        MARKER, "block_0000.safetensors", "block_0001.safetensors", "hidden_0001.safetensors", MANIFEST]
    return d


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _header_end(path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _flip_tensor_data(name):
    def damage(d):
        p = d / name
        _flip(p, (_header_end(p) + p.stat().st_size) // 2)
    return damage


def _rename_tensor(d):
    """One tensor name in the block file's header overwritten (same length)."""
    p = d / "block_0001.safetensors"
    data = p.read_bytes()
    i = data.index(b"self_attn.q_proj")
    p.write_bytes(data[:i] + b"self_attn.x_proj" + data[i + len(b"self_attn.q_proj"):])


def _edit_manifest(change):
    def damage(d):
        manifest = json.loads((d / MANIFEST).read_text())
        change(manifest)
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return damage


def _flip_manifest_digit(d):
    """A digit of a layer's recorded loss changed in place (the file stays valid JSON)."""
    p = d / MANIFEST
    text = p.read_text()
    i = text.index('"loss_method": ') + len('"loss_method": ') + 2
    assert text[i].isdigit()
    p.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])


def _remove_tensor(rehash: bool):
    """``model.layers.1.mlp.down_proj`` dropped from block_0001; with ``rehash`` the manifest
    is rewritten to match (size, file hash and its own hash), so only the block's tensor list
    can tell."""
    def damage(d):
        p = d / "block_0001.safetensors"
        tensors = load_file(str(p))
        del tensors["model.layers.1.mlp.down_proj"]
        save_file(tensors, str(p))
        if rehash:
            manifest = json.loads((d / MANIFEST).read_text())
            manifest["files"][p.name] = {"size": p.stat().st_size, "sha256": file_sha256(p)}
            manifest["sha256"] = content_sha256(manifest)
            (d / MANIFEST).write_text(json.dumps(manifest))
    return damage


DAMAGE = {
    "block data byte": (_flip_tensor_data("block_0000.safetensors"), "block_0000"),
    "block header byte": (lambda d: _flip(d / "block_0001.safetensors", 20), "block_0001"),
    "block tensor renamed": (_rename_tensor, "block_0001"),
    "hidden data byte": (_flip_tensor_data("hidden_0001.safetensors"), "hidden_0001"),
    "hidden header byte": (lambda d: _flip(d / "hidden_0001.safetensors", 12), "hidden_0001"),
    "block tensor removed": (_remove_tensor(rehash=False), "block_0001"),
    "block tensor removed, manifest rehashed": (_remove_tensor(rehash=True),
                                                "block_0001.*lacks model.layers.1.mlp.down_proj"),
    "manifest done_blocks edited": (_edit_manifest(lambda m: m.update(done_blocks=3)), MANIFEST),
    "manifest file hash edited": (
        _edit_manifest(lambda m: m["files"]["block_0000.safetensors"].update(sha256="0" * 64)), MANIFEST),
    "manifest record byte": (_flip_manifest_digit, MANIFEST),
    "file deleted": (lambda d: (d / "block_0000.safetensors").unlink(), "block_0000"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused(partial_checkpoint, tmp_path, case):
    damage, names = DAMAGE[case]
    d = tmp_path / "ck"
    shutil.copytree(partial_checkpoint, d)
    sizes = {p.name: p.stat().st_size for p in d.iterdir()}
    damage(d)
    if "removed" not in case and "edited" not in case and "deleted" not in case:
        assert {p.name: p.stat().st_size for p in d.iterdir()} == sizes  # size unchanged
    with pytest.raises(CheckpointError, match=f"corrupt.*{names}.*--restart"):
        prune_model(tiny_model("llama", layers=3), settings=SETTINGS, calibration=IDS, progress=False,
                    checkpoint=Checkpoint.open(d, "id"))


def test_intact_checkpoint_resumes(partial_checkpoint, tmp_path):
    """The undamaged copy resumes to the uninterrupted run's weights (so the refusals above
    come from the damage, not from the copying)."""
    d = tmp_path / "ck"
    shutil.copytree(partial_checkpoint, d)
    reference = tiny_model("llama", layers=3)
    prune_model(reference, settings=SETTINGS, calibration=IDS, progress=False)
    resumed = tiny_model("llama", layers=3)
    report = prune_model(resumed, settings=SETTINGS, calibration=IDS, progress=False,
                         checkpoint=Checkpoint.open(d, "id"))
    assert report.resumed_from_block == 2
    for key, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_old_format_is_refused(partial_checkpoint, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(partial_checkpoint, d)
    _edit_manifest(lambda m: m.update(format=1))(d)
    with pytest.raises(CheckpointError, match="format 1.*--restart"):
        Checkpoint.open(d, "id")


def test_checkpoint_from_before_markers_resumes_and_a_users_manifest_does_not(partial_checkpoint, tmp_path):
    """A checkpoint written before checkpoints carried a marker (its manifest's own SHA-256
    holds) is adopted and resumes; a folder whose manifest.json nmprune did not write stays
    the user's."""
    from nmprune.output import NotOwnedError

    d = tmp_path / "ck"
    shutil.copytree(partial_checkpoint, d)
    (d / MARKER).unlink()
    assert Checkpoint.open(d, "id").done_blocks == 2 and (d / MARKER).is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / MANIFEST).write_text(json.dumps({"format": 2, "files": {}}))
    with pytest.raises(NotOwnedError):
        Checkpoint.open(mine, "id", restart=True)
    assert sorted(p.name for p in mine.iterdir()) == [MANIFEST]
