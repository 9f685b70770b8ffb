"""Damaged state and failed recomputes never crash deep inside torch, and never pass a half-written
result off as done: each case below gives a message naming the path and the fix, or a logged
fall-back (to computing the result again, or to the checkpoint before). The runs are the small
speedrun's stages in this process, through Prefect and MLflow."""

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.seeded import seed
from tests.test_pipeline import SMALL

pytestmark = pytest.mark.slow


def sft_run(root: Path, extra=(), recompute=(), fault=None) -> dict:
    from flows.speedrun import sft_flow

    return sft_flow(preset="tiny", overrides=SMALL + [f"artifact_root={root}", *extra], recompute=list(recompute),
                    fault=fault or {})


def said(caplog, needle: str) -> str:
    """The logged line that contains `needle` (printed: the closing note quotes them)."""
    line = next(r.getMessage() for r in caplog.records if needle in r.getMessage())
    print(f"\n  logged: {line}")
    return line


def stage(result: dict, name: str) -> dict:
    return next(s for s in result["stages"] if s["stage"] == name)


@pytest.fixture
def done(tmp_path, small_sft):
    """A finished SFT (and its data and tokenizer) on a root of its own: a copy of the session's."""
    result = sft_run(seed(small_sft, tmp_path))
    assert [s["cache_hit"] for s in result["stages"]] == [True] * 3
    return tmp_path, result


def test_garbled_manifest_is_logged_and_the_stage_recomputed(done, caplog):
    root, first = done
    data = Path(stage(first, "prepare_data")["uri"])
    manifest = data / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])  # truncated mid-write
    with caplog.at_level(logging.WARNING):
        again = sft_run(root)
    assert "treated as uncommitted" in said(caplog, f"{manifest} is unreadable")
    assert not stage(again, "prepare_data")["cache_hit"]
    assert json.loads(manifest.read_text())["key"] == stage(first, "prepare_data")["key"]


def test_missing_model_files_are_logged_and_recomputed_beside(done, caplog):
    root, first = done
    sft = Path(stage(first, "sft")["uri"])
    weights = next((sft / "model").glob("*.safetensors"))
    weights.unlink()
    with caplog.at_level(logging.WARNING):
        again = sft_run(root)
    said(caplog, f"the result at {sft} is damaged (model/{weights.name} is missing)")
    assert not stage(again, "sft")["cache_hit"] and weights.is_file()
    assert stage(sft_run(root), "sft")["cache_hit"]  # whole again: a cache hit


def test_failed_recompute_keeps_the_old_result(done, caplog):
    root, first = done
    sft = Path(stage(first, "sft")["uri"])
    before = json.loads((sft / "manifest.json").read_text())
    from trainer.faults import InjectedFault

    with caplog.at_level(logging.ERROR), pytest.raises(InjectedFault):
        sft_run(root, recompute=["sft"], fault={"sft": 7})
    said(caplog, "the recompute failed; the earlier result at")
    assert json.loads((sft / "manifest.json").read_text()) == before
    assert stage(sft_run(root), "sft")["cache_hit"]  # still served from cache
    again = sft_run(root, recompute=["sft"])
    after = json.loads((sft / "manifest.json").read_text())
    assert not stage(again, "sft")["cache_hit"] and after["mlflow_run_id"] != before["mlflow_run_id"]
    assert after["key"] == before["key"] and (sft / "model" / "config.json").is_file()
    assert not any((sft.parent / ".staging").iterdir()), "the staging folder was left behind"


@pytest.mark.parametrize("damage", ["truncated", "missing", "garbled"])
def test_damaged_checkpoint_falls_back_to_the_one_before(tmp_path, caplog, damage):
    """SFT fails after step 11 (checkpoints at 5 and 10); step 10's checkpoint is then damaged. The
    re-run logs it and resumes from step 5. Garbled (same size, other bytes) fails DeepSpeed's load,
    which is caught and logged the same way."""
    from trainer.faults import InjectedFault

    with pytest.raises(InjectedFault):
        sft_run(tmp_path, fault={"sft": 11})
    [folder] = tmp_path.glob("sft/*")
    step10 = folder / "checkpoints" / "step00000010"
    target = max((f for f in step10.rglob("*.pt")), key=lambda f: f.stat().st_size)
    size = target.stat().st_size
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[: size // 2])
    elif damage == "missing":
        target.unlink()
    else:
        target.write_bytes(b"\0" * size)
    with caplog.at_level(logging.WARNING):
        result = sft_run(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["result"]["resumed_from_step"] == 5, caplog.text[-3000:]
    if damage == "garbled":
        said(caplog, f"checkpoint {step10} could not be loaded")
    else:
        said(caplog, f"checkpoint {step10} is damaged ({target.relative_to(step10)}")
    assert not stage(result, "sft")["cache_hit"]


def test_every_checkpoint_damaged_names_the_folder_and_the_fix(tmp_path):
    from trainer.checkpoint import CheckpointError
    from trainer.faults import InjectedFault

    with pytest.raises(InjectedFault):
        sft_run(tmp_path, fault={"sft": 11})
    [folder] = tmp_path.glob("sft/*")
    for f in folder.glob("checkpoints/step*/*.pt"):
        f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint under .*checkpoints could be loaded") as exc:
        sft_run(tmp_path)
    assert f"delete {folder / 'checkpoints'} to start this stage over" in str(exc.value)
    print(f"\n  raised: {exc.value}")
    assert not (folder / "manifest.json").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MiB tmpfs (needs root, as on CI)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()}); CI runs as root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_a_checkpoint(small_disk, tmp_path):
    """The data and tokenizer fit; SFT's first checkpoint (weights + Adam state of a ~0.4M-parameter
    model, about 5 MiB) does not. The error names the checkpoint and the fix, the torn checkpoint is
    removed and nothing is committed."""
    from trainer.checkpoint import CheckpointError

    bigger = ["model.hidden_size=128", "model.num_layers=2", "model.intermediate_size=256"]
    with pytest.raises(CheckpointError) as exc:
        sft_run(small_disk, bigger)
    text = str(exc.value)
    print(f"\n  raised: {text}")
    assert "saving checkpoint" in text and "step00000005" in text and "MiB free there" in text, text
    assert "Free space on that disk" in text
    [folder] = small_disk.glob("sft/*")
    assert not (folder / "manifest.json").exists()
    assert not list(folder.glob("checkpoints/step*")), "a torn checkpoint was left behind"
    # with room again, the same command finishes
    shutil.copytree(small_disk, tmp_path / "roomy", dirs_exist_ok=True)
    result = sft_run(tmp_path / "roomy", bigger)
    assert json.loads((Path(stage(result, "sft")["uri"]) / "manifest.json").read_text())["stage"] == "sft"
