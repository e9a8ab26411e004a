"""The allocator engines run with: the system's tcmalloc first in LD_PRELOAD, found where Debian/Ubuntu install it."""

from __future__ import annotations

from pathlib import Path

from serving.launch.malloc import find_tcmalloc, with_tcmalloc


def test_the_minimal_tcmalloc_is_found_first_and_nothing_where_there_is_none(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert find_tcmalloc([a, b]) is None
    (b / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([a, b]) == b / "libtcmalloc.so.4"
    (b / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc([a, b]) == b / "libtcmalloc_minimal.so.4"  # no heap profiler needed
    (a / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([a, b]) == a / "libtcmalloc.so.4"  # the first directory wins


def test_tcmalloc_goes_first_in_ld_preload_once():
    lib = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert with_tcmalloc({"PATH": "/bin"}, lib) == {"PATH": "/bin", "LD_PRELOAD": str(lib)}
    assert with_tcmalloc({"LD_PRELOAD": "/x/libgomp.so.1"}, lib)["LD_PRELOAD"] == f"{lib}:/x/libgomp.so.1"
    mine = {"LD_PRELOAD": "/opt/libtcmalloc.so.4"}  # the operator's own tcmalloc stays
    assert with_tcmalloc(mine, lib) == mine and with_tcmalloc(mine, lib) is not mine
    assert with_tcmalloc({"PATH": "/bin"}, None) == {"PATH": "/bin"}
