"""The documentation: the site builds strictly with every page in its nav, the README stays short, and citations
point inside the repository or to a paper by name and section, never to a private spec, anchors file or issue."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 15_000  # bytes
PACKAGES = ("predictor", "training", "serving", "registry", "monitoring")
FORBIDDEN = {
    "a private spec section": re.compile(r"SPEC §", re.IGNORECASE),
    "the anchors file": re.compile(r"ANCHORS\.md", re.IGNORECASE),
    "an issue number": re.compile(r"\bissue \d+\b", re.IGNORECASE),
}


def nav_pages(nav) -> list[str]:
    """Every Markdown file named in mkdocs.yml's nav, sections flattened."""
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out += nav_pages(value)
        elif isinstance(value, str) and value.endswith(".md"):
            out.append(value)
    return out


def built_page(site: Path, page: str, directory_urls: bool) -> Path:
    """Where mkdocs writes ``page``: foo/bar.md -> foo/bar/index.html (foo/bar.html without directory URLs)."""
    stem = page[:-len(".md")]
    if stem == "index" or stem.endswith("/index") or not directory_urls:
        return site / f"{stem}.html"
    return site / stem / "index.html"


@pytest.mark.unit
def test_site_builds_strictly_with_every_nav_page(tmp_path):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    assert pages, "mkdocs.yml has no pages in its nav"
    docs = ROOT / config.get("docs_dir", "docs")
    on_disk = sorted(str(p.relative_to(docs)) for p in docs.rglob("*.md"))
    assert sorted(pages) == on_disk, f"nav and docs/ differ: nav {sorted(pages)}, files {on_disk}"

    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    directory_urls = config.get("use_directory_urls", True)
    missing = [p for p in pages if not built_page(site, p, directory_urls).is_file()]
    assert not missing, f"pages in the nav that were not built: {missing}"


def text_files(paths: list[Path]):
    for path in paths:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix in {".pyc", ".png", ".onnx", ".gguf"}:
                continue
            try:
                yield f, f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


@pytest.mark.unit
def test_readme_is_short_and_citations_are_public():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it under {README_LIMIT} and move detail to docs/"

    scanned = [ROOT / "README.md", ROOT / "docs", *(ROOT / p for p in PACKAGES)]
    bad = []
    for path, text in text_files(scanned):
        for what, pattern in FORBIDDEN.items():
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{path.relative_to(ROOT)}:{line}: {what} ({m.group(0)!r})")
    assert not bad, ("cite the repository or a paper by name and section (e.g. 'Aladdin Alg. 1', 'EcoServe §4'), "
                     "not:\n" + "\n".join(bad))
