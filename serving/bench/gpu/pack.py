"""Build `.gpu-pack/`: what a lent GPU machine lacks to run the engine benchmark on CUDA vLLM.

That machine has an H200 (sm_90), Python 3.12, torch 2.11 and a fixed set of packages, no package registry, and
the working tree that travels to it must stay under about 60 MiB. vLLM's CUDA wheel unpacks to 700 MB, mostly
GPU kernels for every architecture from sm_75 to sm_120, so the pack holds:

* `wheels/vllm-<version>-...whl`: the CUDA wheel with the libraries a dense Llama model on one Hopper GPU never
  loads left out (DROP_RULES says which and why), every other architecture's kernels zeroed in place inside the
  libraries it keeps (zero_fatbin_section), and its members compressed with LZMA instead of deflate (the zeroed
  libraries shrink under LZMA; deflate leaves them three times larger). pip installs such a wheel like any other.
* `wheels/*.whl`: the import-time dependencies of vLLM's offline engine and of our benchmark code that the GPU
  image does not hold (DEPENDENCIES), at one pinned version each.
* `manifest.json`: every file with its size and sha256, what was dropped or zeroed and why, the sizes before and
  after, the dependency list.
* `install.sh`: installs the wheels into a folder to put on PYTHONPATH, without a registry.

Everything downloaded is kept in a cache folder (--cache) and reused, as is the stripped wheel while the recipe
(drop rules, target architecture) is unchanged. `python -m serving.bench.gpu.check` then checks, on the GPU
machine, that the modules the benchmark needs import and that the stripped libraries' kernels still run.
"""

from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import json
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from serving.progress import logged

VLLM_VERSION = "0.26.0"
# The GPU machine: an H200, compute capability 9.0; only its kernels are kept.
TARGET_SM = 90
# What travels to the GPU machine is capped at 60 MiB, the git-tracked tree included: the pack gets what is left.
PACK_BUDGET_BYTES = 50 * 1024 * 1024
DEFAULT_OUT = Path(".gpu-pack")
DEFAULT_CACHE = Path.home() / ".cache" / "lengthwise" / "gpu-pack"
# Bump when the stripping itself changes, so a cached stripped wheel is rebuilt.
STRIP_RECIPE_VERSION = 1

# The GPU machine's interpreter and platform: wheels are fetched for it, not for the machine that builds the pack.
PIP_TARGET_ARGS: tuple[str, ...] = (
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_31_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
)

# The import-time dependencies the GPU image lacks, one pinned version each (`pip download --no-deps`): found by
# importing vLLM's offline engine (vllm.LLM, the V1 engine core, the uniproc executor, the GPU worker and model
# runner, Llama, the FlashAttention and Triton attention backends, the sampler, the structured-output manager)
# and our benchmark code in a Python 3.12 environment holding only the image's packages, until nothing was missing.
DEPENDENCIES: tuple[tuple[str, str], ...] = (
    # pydantic: vLLM's configs are pydantic dataclasses, our policy and engine settings pydantic models. pydantic-core
    # wants typing-extensions >= 4.16, newer than the image may hold, so that one file travels too.
    ("pydantic", "2.14.4"),
    ("pydantic-core", "2.50.5"),
    ("annotated-types", "0.8.0"),
    ("typing-inspection", "0.4.5"),
    ("typing-extensions", "4.16.0"),
    # the engine core's messaging and hashing: ZeroMQ sockets, msgspec and CBOR encoding, base64 of tensors.
    ("pyzmq", "27.3.0"),
    ("msgspec", "0.23.0"),
    ("cbor2", "6.3.0"),
    ("pybase64", "1.5.1"),
    ("cachetools", "8.0.2"),
    # imported by vllm.LLM's chat and request types even offline: the OpenAI client's types (with the HTTP stack it
    # declares, so it installs whole), the Harmony format, partial JSON, FastAPI and Starlette.
    ("openai", "3.57.0"),
    ("httpx2", "2.16.2"),
    ("httpcore2", "2.16.2"),
    ("truststore", "0.10.5"),
    ("jiter", "0.19.0"),
    ("sniffio", "1.3.1"),
    ("openai-harmony", "0.0.8"),
    ("partial-json-parser", "0.2.1.1.post7"),
    ("fastapi", "0.136.3"),
    ("starlette", "1.10.0"),
    # the structured-output manager's backends, imported with it: xgrammar at the newest version that takes vLLM's
    # pin of apache-tvm-ffi (0.1.10), and llguidance inside vLLM's range.
    ("xgrammar", "0.2.7"),
    ("apache-tvm-ffi", "0.1.10"),
    ("llguidance", "1.7.6"),
)

# The GPU image's packages, as last read (a version where one was read): a dependency is carried when the image
# lacks it, or when what depends on it needs a version newer than the image may hold; the manifest says which.
GPU_IMAGE_PACKAGES: dict[str, str | None] = {
    "huggingface-hub": "1.33.0", "numpy": "2.5.2", "onnxruntime": "1.30.0", "safetensors": "0.8.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
    "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
    **dict.fromkeys((
        "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc", "anyio",
        "attrs", "botorch", "build", "certifi", "charset-normalizer", "chex", "click", "cloudpickle", "cmake",
        "colorama", "contourpy", "coverage", "cuda-bindings", "cuda-core", "cuda-pathfinder", "cuda-toolkit",
        "cupy-cuda13x", "cycler", "cython", "diffrax", "e3nn", "einops", "equinox", "etils", "execnet", "filelock",
        "flatbuffers", "flax", "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py",
        "hf-xet", "httpcore", "httpx", "humanize", "hypothesis", "idna", "imageio", "iniconfig", "interface-meta",
        "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib", "jaxtyping", "jinja2", "joblib", "kiwisolver",
        "lazy-loader", "lightning", "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml",
        "markdown", "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py", "mpmath",
        "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind", "narwhals", "networkx", "ninja",
        "numba", "numba-cuda", "numpyro", "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc",
        "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile", "nvidia-curand",
        "nvidia-cusolver", "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13",
        "nvidia-nvjitlink", "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxscript",
        "opencv-python-headless", "opt-einsum", "opt-einsum-fx", "optax", "optimistix", "orbax-checkpoint",
        "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip", "pluggy", "portalocker",
        "prometheus-client", "propcache", "protobuf", "psutil", "py-cpuinfo", "pyarrow", "pybind11", "pygments",
        "pyparsing", "pyproject-hooks", "pyre-extensions", "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock",
        "pytest-timeout", "pytest-xdist", "python-dateutil", "pytorch-lightning", "pyyaml", "regex", "requests",
        "rich", "sacrebleu", "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn",
        "sentence-transformers", "setuptools", "shellingham", "simplejson", "six", "sortedcontainers", "statsmodels",
        "sympy", "tabulate", "tensorboard", "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile",
        "timm", "toolz", "torch-geometric", "torchdiffeq", "torchmetrics", "tqdm", "treescope", "typer",
        "typing-extensions", "typing-inspect", "urllib3", "uvloop", "wadler-lindig", "werkzeug", "wheel", "wrapt",
        "xarray", "xxhash", "yarl", "zipp",
    )),
}

# Members of vLLM's wheel left out, first match wins: (glob over the member's path, why it is never loaded).
DROP_RULES: tuple[tuple[str, str], ...] = (
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
     "FlashAttention-2 kernels: on sm_90 vLLM picks FlashAttention-3; imported under try/except"),
    ("vllm/_moe_C_stable_libtorch.abi3.so",
     "mixture-of-experts kernels: Llama is dense; imported under contextlib.suppress(ImportError)"),
    ("vllm/_flashmla*.abi3.so", "FlashMLA (MLA attention of DeepSeek models): both imported under try/except"),
    ("vllm/_qutlass_C.abi3.so", "QuTLASS FP4 kernels for Blackwell; imported under contextlib.suppress(ImportError)"),
    ("vllm/_rust_tool_parser.abi3.so", "tool-call parsing of the OpenAI server; imported on first use only"),
    ("vllm/vllm-rs", "the Rust frontend of the OpenAI server (VLLM_RUST_FRONTEND_PATH); never imported"),
    ("vllm/third_party/deep_gemm/*",
     "DeepGEMM FP8 GEMMs with CUDA headers for JIT and _C for five Pythons; without it has_deep_gemm() is False"),
    ("vllm/third_party/fmha_sm100/*", "Blackwell (sm_100) attention for MiniMax models; imported on first use only"),
)


# --- the member filter ---------------------------------------------------------------------------------------------

def drop_reason(member: str, rules: Iterable[tuple[str, str]] = DROP_RULES) -> str | None:
    """Why a wheel member is left out, or None to keep it: the reason travels into the manifest."""
    for pattern, reason in rules:
        if fnmatch.fnmatchcase(member, pattern):
            return reason
    return None


# --- the fatbin: GPU code of every architecture, inside a library's .nv_fatbin section -------------------------------

FATBIN_MAGIC = 0xBA55ED50
# A fatbin: magic, version, header size, size of the entries that follow the header.
_FATBIN_HEADER = struct.Struct("<IHHQ")
# An entry: kind (1 PTX, 2 ELF cubin), version, header size, padded payload size, (unused), payload size, (unused),
# architecture (90 for sm_90 and sm_90a). The payload follows the entry's header.
_ENTRY_HEADER = struct.Struct("<HHIQIIII")
KIND_PTX = 1
KIND_ELF = 2


@dataclass(frozen=True)
class FatbinEntry:
    """One architecture's code in a fatbin: where its payload lies, so it can be zeroed without moving anything."""

    kind: int
    arch: int
    payload_offset: int
    payload_size: int

    @property
    def label(self) -> str:
        kind = {KIND_PTX: "ptx", KIND_ELF: "elf"}.get(self.kind, f"kind{self.kind}")
        return f"{kind} sm_{self.arch}"


@dataclass
class FatbinReport:
    """Bytes of payload kept and zeroed per entry label ("elf sm_90", "ptx sm_80"), summed over a library's fatbins."""

    fatbins: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    zeroed: dict[str, int] = field(default_factory=dict)

    @property
    def zeroed_bytes(self) -> int:
        return sum(self.zeroed.values())

    def add(self, entry: FatbinEntry, kept: bool) -> None:
        into = self.kept if kept else self.zeroed
        into[entry.label] = into.get(entry.label, 0) + entry.payload_size


def fatbins_in(data: bytes | bytearray, start: int, size: int) -> list[list[FatbinEntry]]:
    """The entries of each fatbin in a .nv_fatbin section; fatbins are 8-byte aligned, padding between is skipped."""
    fatbins: list[list[FatbinEntry]] = []
    pos, end = start, start + size
    while pos + _FATBIN_HEADER.size <= end:
        magic, _version, header_size, body_size = _FATBIN_HEADER.unpack_from(data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        entries: list[FatbinEntry] = []
        entry, body_end = pos + header_size, pos + header_size + body_size
        while entry + _ENTRY_HEADER.size <= body_end:
            kind, _version, entry_header, padded, _a, _payload, _b, arch = _ENTRY_HEADER.unpack_from(data, entry)
            entries.append(FatbinEntry(kind, arch, entry + entry_header, padded))
            entry += entry_header + padded
        fatbins.append(entries)
        pos = body_end
    return fatbins


def entries_to_keep(entries: list[FatbinEntry], sm: int) -> set[int]:
    """Indices of the entries the GPU can load: the cubin built for `sm`; without one, the newest PTX not above `sm`.

    The driver picks a cubin of the exact architecture before JIT-compiling PTX, and a cubin of another major
    architecture never runs, so nothing else in the fatbin is ever read on that GPU.
    """
    cubins = {i for i, e in enumerate(entries) if e.kind == KIND_ELF and e.arch == sm}
    if cubins:
        return cubins
    ptx = [(e.arch, i) for i, e in enumerate(entries) if e.kind == KIND_PTX and e.arch <= sm]
    if not ptx:
        return set()
    newest = max(arch for arch, _ in ptx)
    return {i for arch, i in ptx if arch == newest}


def zero_fatbin_section(data: bytearray, start: int, size: int, sm: int = TARGET_SM) -> FatbinReport:
    """Zero, in place, every payload the `sm` GPU never loads; headers, offsets and the length stay as they were.

    The library finds its fatbins by address, so nothing may move: zeroed payloads cost nothing once compressed.
    """
    report = FatbinReport()
    for entries in fatbins_in(data, start, size):
        report.fatbins += 1
        keep = entries_to_keep(entries, sm)
        for i, entry in enumerate(entries):
            report.add(entry, kept=i in keep)
            if i not in keep:
                data[entry.payload_offset:entry.payload_offset + entry.payload_size] = bytes(entry.payload_size)
    return report


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int] | None:
    """(file offset, size) of a named section of a 64-bit little-endian ELF file, or None: no readelf needed."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0:
        return None
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_offset = headers[shstrndx][4]
    wanted = name.encode()
    for name_offset, _type, _flags, _addr, offset, sec_size in headers:
        at = strtab_offset + name_offset
        if data[at:at + len(wanted) + 1] == wanted + b"\0":
            return offset, sec_size
    return None


def strip_library(data: bytes, sm: int = TARGET_SM) -> tuple[bytes, FatbinReport | None]:
    """A shared library with every other architecture's GPU code zeroed, or unchanged (None) without a fatbin."""
    section = elf_section(data, ".nv_fatbin")
    if section is None:
        return data, None
    buf = bytearray(data)
    report = zero_fatbin_section(buf, *section, sm=sm)
    return bytes(buf), report


# --- the stripped wheel --------------------------------------------------------------------------------------------

@dataclass
class StripReport:
    """What happened to vLLM's wheel: the manifest's record of it."""

    source: str
    source_bytes: int
    output: str = ""
    output_bytes: int = 0
    unpacked_before: int = 0
    unpacked_after: int = 0
    dropped: list[dict] = field(default_factory=list)
    zeroed: dict[str, dict] = field(default_factory=dict)


def record_hash(data: bytes) -> str:
    """A RECORD line's hash: pip checks every installed file against it."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_text(rows: list[tuple[str, str, str]], record_path: str) -> str:
    """The RECORD file of the rewritten wheel: every kept member, and RECORD itself without a hash."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerows(rows)
    writer.writerow((record_path, "", ""))
    return out.getvalue()


def strip_wheel(source: Path, output: Path, sm: int = TARGET_SM, rules: Iterable[tuple[str, str]] = DROP_RULES,
                on_member: Callable[[str, int], None] | None = None) -> StripReport:
    """Rewrite vLLM's wheel: members of DROP_RULES left out, other architectures zeroed, LZMA-compressed members.

    The dist-info stays (vLLM reads its own version through importlib.metadata), with a RECORD for the new contents.
    """
    report = StripReport(source=source.name, source_bytes=source.stat().st_size)
    rows: list[tuple[str, str, str]] = []
    record_path = ""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(".partial")
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            if on_member:
                on_member(info.filename, info.file_size)
            report.unpacked_before += info.file_size
            if info.filename.endswith(".dist-info/RECORD"):
                record_path = info.filename
                continue
            reason = drop_reason(info.filename, rules)
            if reason:
                report.dropped.append({"path": info.filename, "bytes": info.file_size, "why": reason})
                continue
            data = src.read(info)
            if info.filename.endswith(".so"):
                data, fatbin = strip_library(data, sm)
                if fatbin is not None:
                    report.zeroed[info.filename] = asdict(fatbin) | {"zeroed_bytes": fatbin.zeroed_bytes}
            out_info = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out_info.external_attr = info.external_attr
            out_info.compress_type = zipfile.ZIP_LZMA
            dst.writestr(out_info, data)
            rows.append((info.filename, record_hash(data), str(len(data))))
            report.unpacked_after += len(data)
        if not record_path:
            raise ValueError(f"{source.name} has no .dist-info/RECORD: not a wheel")
        dst.writestr(record_path, record_text(rows, record_path))
    partial.replace(output)
    report.output = output.name
    report.output_bytes = output.stat().st_size
    return report


def strip_fingerprint(sm: int) -> str:
    """Names the recipe of a stripped wheel: a cached one is reused only while rules and target are unchanged."""
    recipe = json.dumps({"rules": DROP_RULES, "sm": sm, "version": STRIP_RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


# --- downloads -----------------------------------------------------------------------------------------------------

def wheel_prefix(name: str, version: str) -> str:
    """The start of a wheel's file name for a distribution and version (names normalised as wheels spell them)."""
    return f"{name.replace('-', '_').lower()}-{version}-"


def cached_wheel(folder: Path, name: str, version: str) -> Path | None:
    """A wheel already downloaded for that name and version, so a rebuild needs no network."""
    prefix = wheel_prefix(name, version)
    hits = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def download_wheel(folder: Path, name: str, version: str, console: Console) -> Path:
    """One wheel for the GPU machine's Python and platform, without its dependencies (those are pinned here)."""
    hit = cached_wheel(folder, name, version)
    if hit:
        return hit
    folder.mkdir(parents=True, exist_ok=True)
    console.log(f"downloading {name}=={version}")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET_ARGS, "-d", str(folder),
           f"{name}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    hit = cached_wheel(folder, name, version)
    if done.returncode != 0 or hit is None:
        raise RuntimeError(f"pip download {name}=={version} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return hit


# --- the manifest --------------------------------------------------------------------------------------------------

def sha256_of(path: Path) -> str:
    """A file's sha256, read in blocks: the manifest lets the GPU machine's copy be checked against the build."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_metadata(path: Path) -> dict[str, str]:
    """Name and version from a wheel's METADATA: the manifest's dependency list is read off the files themselves."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        fields: dict[str, str] = {}
        for line in zf.read(meta).decode("utf-8", "replace").splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(": ")
            if key in ("Name", "Version") and key.lower() not in fields:
                fields[key.lower()] = value.strip()
    return fields


def in_image(name: str) -> str | bool:
    """Whether the GPU image holds a distribution already (its version when known): such a one is carried newer."""
    key = name.lower().replace("_", "-").replace(".", "-")
    if key not in GPU_IMAGE_PACKAGES:
        return False
    return GPU_IMAGE_PACKAGES[key] or True


def dropped_summary(dropped: list[dict], list_up_to: int = 20) -> list[dict]:
    """The dropped members per reason, with their paths unless there are too many (1,800 CUDA headers are not read
    one by one, and every byte of the manifest travels too)."""
    groups: dict[str, dict] = {}
    for item in dropped:
        group = groups.setdefault(item["why"], {"why": item["why"], "files": 0, "bytes": 0, "paths": []})
        group["files"] += 1
        group["bytes"] += item["bytes"]
        group["paths"].append(item["path"])
    for group in groups.values():
        if group["files"] > list_up_to:
            group["paths"] = sorted({p.rsplit("/", 1)[0] + "/" for p in group["paths"]})[:list_up_to]
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def build_manifest(out: Path, strip: StripReport | None, sm: int = TARGET_SM) -> dict:
    """Everything in the pack, with sizes, hashes and versions, and what was dropped or zeroed from vLLM and why."""
    files = []
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"):
        entry = {"path": path.relative_to(out).as_posix(), "bytes": path.stat().st_size, "sha256": sha256_of(path)}
        if path.suffix == ".whl":
            entry |= wheel_metadata(path)
        files.append(entry)
    return {
        "target": {"python": "3.12", "sm": sm, "platform": "manylinux x86_64"},
        "install": "python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                   "--target SITE wheels/*.whl",
        "total_bytes": sum(f["bytes"] for f in files),
        "files": files,
        "dependencies": [{"name": f["name"], "version": f["version"], "in_image": in_image(f["name"])}
                         for f in files if "name" in f],
        "vllm": asdict(strip) | {"dropped": dropped_summary(strip.dropped)} if strip else None,
    }


# --- the build -----------------------------------------------------------------------------------------------------

INSTALL_SH = """#!/bin/sh
# Installs the pack's wheels into a folder for PYTHONPATH, with no registry: sh install.sh [SITE] (default /tmp/site)
set -e
here=$(dirname "$0")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${1:-/tmp/site}" \\
    "$here"/wheels/*.whl
"""


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def folder_bytes(folder: Path) -> int:
    """What the pack adds to the travelling tree, its manifest included: the number the budget is about."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def stripped_vllm(cache: Path, sm: int, console: Console) -> tuple[Path, StripReport]:
    """vLLM's stripped wheel from the cache, or built from the downloaded CUDA wheel (a few minutes on two cores)."""
    source = download_wheel(cache / "wheels", "vllm", VLLM_VERSION, console)
    folder = cache / f"stripped-sm{sm}-{strip_fingerprint(sm)}"
    output, saved = folder / source.name, folder / "report.json"
    if output.exists() and saved.exists():
        console.log(f"reusing the stripped wheel in {folder}")
        return output, StripReport(**json.loads(saved.read_text()))
    console.log(f"stripping {source.name} ({mib(source.stat().st_size)}) for sm_{sm}")
    with zipfile.ZipFile(source) as zf:
        total = sum(i.file_size for i in zf.infolist())
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress, logged(progress, "gpu-pack"):
        task = progress.add_task("stripping vllm", total=total)

        def advance(name: str, size: int) -> None:
            progress.update(task, advance=size, description=f"stripping {name[-60:]}")

        report = strip_wheel(source, output, sm, on_member=advance)
    saved.write_text(json.dumps(asdict(report), indent=1))
    return output, report


def dropped_by_rule(dropped: list[dict]) -> list[tuple[str, str, int]]:
    """The dropped members summed per rule, biggest first: one table row per reason, not one per header file."""
    sizes: dict[str, int] = {}
    for item in dropped:
        sizes[item["why"]] = sizes.get(item["why"], 0) + item["bytes"]
    rows = [(pattern, why, sizes[why]) for pattern, why in DROP_RULES if why in sizes]
    return sorted(rows, key=lambda r: -r[2])


def print_tables(console: Console, strip: StripReport, manifest: dict) -> None:
    """What went in, with sizes before and after stripping: the build's summary on the terminal."""
    table = Table(title=f"vLLM {VLLM_VERSION}: biggest changes")
    for col in ("member", "before", "after", "what"):
        table.add_column(col, justify="right" if col in ("before", "after") else "left")
    for pattern, why, size in dropped_by_rule(strip.dropped):
        table.add_row(pattern, mib(size), "-", "dropped: " + why.split(":")[0].split(";")[0])
    for path, z in sorted(strip.zeroed.items(), key=lambda kv: -kv[1]["zeroed_bytes"]):
        kept = ", ".join(sorted(z["kept"])) or "nothing"
        table.add_row(path, mib(sum(z["kept"].values()) + z["zeroed_bytes"]), mib(sum(z["kept"].values())),
                      f"GPU code zeroed, kept {kept}")
    table.add_row("unpacked vllm", mib(strip.unpacked_before), mib(strip.unpacked_after), "")
    table.add_row("wheel file", mib(strip.source_bytes), mib(strip.output_bytes), "deflate -> LZMA members")
    console.print(table)
    files = Table(title=f"{DEFAULT_OUT}/ contents")
    for col in ("file", "version", "size"):
        files.add_column(col, justify="right" if col == "size" else "left")
    for f in manifest["files"]:
        files.add_row(f["path"], f.get("version", ""), mib(f["bytes"]))
    files.add_row("total", "", mib(manifest["total_bytes"]))
    console.print(files)


def build(out: Path, cache: Path, sm: int, console: Console) -> dict:
    """The whole pack: stripped vLLM, dependency wheels, install script, manifest; refuses to exceed the budget."""
    started = time.monotonic()
    vllm_wheel, strip = stripped_vllm(cache, sm, console)
    deps = [download_wheel(cache / "wheels", name, version, console) for name, version in DEPENDENCIES]
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    for wheel in (vllm_wheel, *deps):
        shutil.copy2(wheel, out / "wheels" / wheel.name)
    (out / "install.sh").write_text(INSTALL_SH)
    manifest = build_manifest(out, strip, sm)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print_tables(console, strip, manifest)
    console.log(f"{out}/ written in {time.monotonic() - started:.0f} s: {mib(folder_bytes(out))} with the manifest, "
                f"of a {mib(PACK_BUDGET_BYTES)} budget")
    return manifest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m serving.bench.gpu.pack",
        description="Build the GPU pack: vLLM's CUDA wheel stripped to one GPU architecture (LZMA members), the "
                    "wheels of the import-time dependencies the GPU image lacks, an install script and a manifest. "
                    "Carry the folder to the GPU machine, run `sh .gpu-pack/install.sh /tmp/site`, put /tmp/site "
                    "and the repository on PYTHONPATH, and check with `python3 -m serving.bench.gpu.check`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the pack folder; replaced as a whole on every build")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help="downloaded wheels and the stripped vLLM wheel, reused by later builds")
    parser.add_argument("--sm", type=int, default=TARGET_SM,
                        help="the GPU's compute capability as one number (90 = Hopper): its kernels are kept")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    build(args.out, args.cache, args.sm, console)
    size = folder_bytes(args.out)
    if size > PACK_BUDGET_BYTES:
        console.print(f"[red]{args.out}/ is {mib(size)}, over the {mib(PACK_BUDGET_BYTES)} budget")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
