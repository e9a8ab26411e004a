"""The GPU pack's pure parts: which vLLM members go, which GPU code is zeroed, the manifest, the check's refusals."""

from __future__ import annotations

import struct
import zipfile

import pytest

from serving.bench.gpu import check, pack

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("member", "dropped"), [
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", True),
    ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", False),
    ("vllm/vllm_flash_attn/flash_attn_interface.py", False),
    ("vllm/_C_stable_libtorch.abi3.so", False),
    ("vllm/_moe_C_stable_libtorch.abi3.so", True),
    ("vllm/_flashmla_C.abi3.so", True),
    ("vllm/_qutlass_C.abi3.so", True),
    ("vllm/vllm-rs", True),
    ("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", True),
    ("vllm/third_party/deep_gemm/include/deep_gemm/common/utils.cuh", True),
    ("vllm/third_party/fmha_sm100/api.py", True),
    ("vllm/third_party/pynvml.py", False),
    ("vllm/third_party/flashmla/flash_mla_interface.py", False),
    ("vllm/v1/engine/core.py", False),
    ("vllm-0.26.0.dist-info/METADATA", False),
])
def test_member_filter(member, dropped):
    reason = pack.drop_reason(member)
    assert (reason is not None) == dropped
    if dropped:
        assert len(reason) > 20  # a reason a reader of the manifest can act on, not a flag


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    padded = payload + b"\0" * (-len(payload) % 8)
    header = struct.pack("<HHIQIIII", kind, 0x101, 64, len(padded), 0, len(payload), 0, arch)
    return header + b"\0" * (64 - len(header)) + padded


def _fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", pack.FATBIN_MAGIC, 1, 16, len(body)) + body


def _headers(data: bytes, fatbins: list[list[pack.FatbinEntry]]) -> list[bytes]:
    return [data[e.payload_offset - 64:e.payload_offset] for entries in fatbins for e in entries]


def test_fatbin_zeroing_keeps_the_sm90_cubin_or_else_the_newest_ptx():
    one = _fatbin(_entry(pack.KIND_ELF, 80, b"A" * 24), _entry(pack.KIND_ELF, 90, b"B" * 40),
                  _entry(pack.KIND_PTX, 90, b"C" * 16), _entry(pack.KIND_ELF, 100, b"D" * 8))
    two = _fatbin(_entry(pack.KIND_PTX, 75, b"E" * 8), _entry(pack.KIND_PTX, 89, b"F" * 16),
                  _entry(pack.KIND_PTX, 120, b"G" * 8), _entry(pack.KIND_ELF, 86, b"H" * 8))
    section = one + b"\0" * 8 + two  # padding between fatbins is skipped
    blob = b"prefix--" + section + b"--suffix"
    buf = bytearray(blob)
    before = pack.fatbins_in(blob, 8, len(section))
    assert [[e.label for e in entries] for entries in before] == [
        ["elf sm_80", "elf sm_90", "ptx sm_90", "elf sm_100"], ["ptx sm_75", "ptx sm_89", "ptx sm_120", "elf sm_86"]]

    report = pack.zero_fatbin_section(buf, 8, len(section), sm=90)

    assert len(buf) == len(blob) and buf[:8] == blob[:8] and buf[-8:] == blob[-8:]
    assert _headers(bytes(buf), before) == _headers(blob, before)
    survivors = bytes(b for b in buf[8:-8] if chr(b) in "ABCDEFGH")
    assert survivors == b"B" * 40 + b"F" * 16
    assert report.fatbins == 2
    assert report.kept == {"elf sm_90": 40, "ptx sm_89": 16}
    assert report.zeroed == {"elf sm_80": 24, "ptx sm_90": 16, "elf sm_100": 8, "ptx sm_75": 8, "ptx sm_120": 8,
                             "elf sm_86": 8}
    assert pack.fatbins_in(bytes(buf), 8, len(section)) == before


def test_a_library_without_a_fatbin_is_left_alone():
    data = b"not an ELF file at all"
    assert pack.strip_library(data) == (data, None)


def _fake_wheel(path):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("tinypkg/__init__.py", "x = 1\n")
        zf.writestr("tinypkg/data.bin", b"\1" * 1000)
        zf.writestr("tinypkg-1.2.3.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.2.3\n\nBody")
        zf.writestr("tinypkg-1.2.3.dist-info/RECORD", "")
    return path


def test_manifest_lists_files_sizes_and_versions(tmp_path):
    out = tmp_path / "pack"
    (out / "wheels").mkdir(parents=True)
    wheel = _fake_wheel(out / "wheels" / "tinypkg-1.2.3-py3-none-any.whl")
    (out / "install.sh").write_text("#!/bin/sh\n")
    manifest = pack.build_manifest(out, None)
    by_path = {f["path"]: f for f in manifest["files"]}
    assert set(by_path) == {"wheels/tinypkg-1.2.3-py3-none-any.whl", "install.sh"}
    assert by_path["wheels/tinypkg-1.2.3-py3-none-any.whl"]["bytes"] == wheel.stat().st_size
    assert len(by_path["install.sh"]["sha256"]) == 64
    assert manifest["total_bytes"] == wheel.stat().st_size + len("#!/bin/sh\n")
    assert manifest["dependencies"] == [{"name": "tinypkg", "version": "1.2.3", "in_image": False}]
    assert pack.in_image("typing_extensions") is True and pack.in_image("Torch") == "2.11.0"


def test_strip_wheel_drops_members_rewrites_record_and_compresses_with_lzma(tmp_path):
    report = pack.strip_wheel(_fake_wheel(tmp_path / "tinypkg-1.2.3-py3-none-any.whl"), tmp_path / "out" / "t.whl",
                              rules=(("tinypkg/data.bin", "not needed: test"),))
    assert report.dropped == [{"path": "tinypkg/data.bin", "bytes": 1000, "why": "not needed: test"}]
    with zipfile.ZipFile(tmp_path / "out" / "t.whl") as zf:
        assert "tinypkg/data.bin" not in zf.namelist()
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_LZMA}
        record = zf.read("tinypkg-1.2.3.dist-info/RECORD").decode()
    assert record.startswith("tinypkg/__init__.py,sha256=")
    assert "data.bin" not in record


def test_check_refuses_a_missing_pack_folder_with_one_line(tmp_path, capsys):
    assert check.main(["--pack", str(tmp_path / "absent"), "--no-gpu"]) == check.FAILED
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL pack:")


def test_check_refuses_another_python(tmp_path, capsys, monkeypatch):
    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.setattr(check, "PYTHON", (2, 7))
    assert check.main(["--pack", str(tmp_path), "--no-gpu"]) == check.FAILED
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL python:")


def test_dropped_members_are_summed_per_reason():
    dropped = [{"path": f"vllm/third_party/x/h{i}.h", "bytes": 10, "why": "headers"} for i in range(30)]
    dropped.append({"path": "vllm/a.so", "bytes": 500, "why": "library"})
    summary = pack.dropped_summary(dropped)
    assert [(g["why"], g["files"], g["bytes"]) for g in summary] == [("library", 1, 500), ("headers", 30, 300)]
    assert summary[0]["paths"] == ["vllm/a.so"] and summary[1]["paths"] == ["vllm/third_party/x/"]
