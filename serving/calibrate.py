"""``lengthwise calibrate``: one's own model's lone-request times (EcoServe's t_p and t_g) and step profile, written to a
file and printed as the flags the other commands take.

It runs no calibration of its own: it puts the two the project already runs one command away.

- ``--url URL``, a running OpenAI-compatible engine (or a gateway in front of one): :func:`serving.demo.calibrate`, what
  ``lengthwise demo`` measures before its replay. ``--requests`` prompts of the workload go one at a time, each asking
  for exactly ``--tokens`` output tokens; t_p is their median time to the first token, t_g their median time per later
  token, as a client measures them. What each engine step computed is recorded only inside the engine, so this way
  gives no step profile.
- ``--model PATH``, a Hugging Face directory or a GGUF: :func:`serving.bench.engine.bench.calibrate_model`, the engine
  bench's calibration. ``--requests`` prompts in the model's chat template run as one burst through stock vLLM on this
  machine, every step recorded (:mod:`serving.engine.profile`); the step model ``c0 + c1 x prefill + c2 x decode +
  c3 x KV read`` is fitted to the steps (:class:`serving.perf.latency.FittedLatency`), and t_p and t_g are what it gives
  a request running alone (:func:`serving.perf.slo.derive_slo`). It needs the accelerator the engine will use, free.

Both write ``OUT/calibration.json`` (t_p, t_g, the SLO they give and the flags below; with ``--model`` also the fitted
step model and ``OUT/step_profile.csv``) and ``OUT/calibration.env`` (the same as shell variables, :func:`shell_env`),
and print the flags to pass on: ``lengthwise serve --t-p --t-g --slo-scale`` (the gateway's deadline, EcoServe's JCT
SLO ``scale x (t_p + t_g x predicted length)``), ``--latency-profile`` for the placements that plan with latency
limits, ``lengthwise replay --slo-ttft-ms --slo-tpot-ms`` and ``lengthwise simulate --latency-model fitted:CSV``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

PROFILE_PLACEMENTS = "aladdin, lengthwise, lengthwise-pack"  # the placements --latency-profile is for
URL_REQUESTS, MODEL_REQUESTS = 3, 64  # --requests' default in each mode
ENV_FILE = "calibration.env"  # the times as shell variables: `set -a; . calibration.env; set +a`

EPILOG = """\
examples:
  # against a running engine (or gateway): t_p and t_g as a client sees them, in seconds
  lengthwise calibrate --url http://gpu-0:8001 --out calibration
  # the model's own step profile too: a burst through stock vLLM here (the accelerator must be free)
  lengthwise calibrate --model /models/my-model --requests 64 --max-tokens 1024 --out calibration

prints the flags to pass on, e.g.
  lengthwise serve ... --t-p 0.041200 --t-g 0.015300 --slo-scale 2
  lengthwise serve --placement lengthwise ... --latency-profile calibration/step_profile.csv
  lengthwise replay ... --slo-ttft-ms 82.4 --slo-tpot-ms 30.60
  lengthwise simulate ... --latency-model fitted:calibration/step_profile.csv
and writes them, with t_p, t_g and the fit, to OUT/calibration.json; OUT/calibration.env holds them as shell
variables (T_P, T_G, SLO_SCALE, SLO_TTFT_MS, SLO_TPOT_MS, LATENCY_PROFILE): set -a; . OUT/calibration.env; set +a
"""


class CalibrateError(RuntimeError):
    """Bad input or a failed run; the message is the one line the command prints."""


def flags(t_p: float, t_g: float, scale: float, profile: Path | None) -> dict[str, list[str]]:
    """The flags each command takes from a calibration: ``serve`` (the gateway's deadline), ``serve_placement`` (the
    step profile, for :data:`PROFILE_PLACEMENTS`), ``replay`` (the SLO headers a client sends, as ``lengthwise demo``
    sends them) and ``simulate`` (the step model); the last two only with a profile."""
    out = {"serve": ["--t-p", f"{t_p:.6f}", "--t-g", f"{t_g:.6f}", "--slo-scale", f"{scale:g}"],
           "replay": ["--slo-ttft-ms", f"{scale * t_p * 1e3:.1f}", "--slo-tpot-ms", f"{scale * t_g * 1e3:.2f}"]}
    if profile is not None:
        out["serve_placement"] = ["--latency-profile", str(profile)]
        out["simulate"] = ["--latency-model", f"fitted:{profile}"]
    return out


def report(t_p: float, t_g: float, scale: float, how: dict[str, Any], profile: Path | None = None,
           step_model: dict[str, Any] | None = None, served: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``calibration.json`` holds: the times, the SLO they give, how they were measured and the flags."""
    if not (t_p > 0 and t_g > 0):
        raise CalibrateError(f"the calibration measured t_p {t_p:g} s and t_g {t_g:g} s; both must be positive")
    return {"t_p_s": t_p, "t_g_s": t_g, "slo_scale": scale, "slo_ttft_ms": scale * t_p * 1e3,
            "slo_tpot_ms": scale * t_g * 1e3, **how, "step_profile": str(profile) if profile else None,
            "step_model": step_model, "served_lengths": served, "flags": flags(t_p, t_g, scale, profile),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def shell_env(rep: dict[str, Any]) -> dict[str, str]:
    """``calibration.env``'s variables (``set -a; . calibration.env; set +a`` loads them), which docs/adopt.md's
    commands use: ``T_P``, ``T_G`` and ``SLO_SCALE`` for ``lengthwise serve``, ``SLO_TTFT_MS`` and ``SLO_TPOT_MS`` for
    ``lengthwise replay``, and with a step profile ``LATENCY_PROFILE``, its absolute path."""
    env = {"T_P": f"{rep['t_p_s']:.6f}", "T_G": f"{rep['t_g_s']:.6f}", "SLO_SCALE": f"{rep['slo_scale']:g}",
           "SLO_TTFT_MS": f"{rep['slo_ttft_ms']:.1f}", "SLO_TPOT_MS": f"{rep['slo_tpot_ms']:.2f}"}
    if rep["step_profile"]:
        env["LATENCY_PROFILE"] = rep["step_profile"]
    return env


def flag_lines(rep: dict[str, Any]) -> list[str]:
    """The flags as the lines printed at the end, one per command that takes them."""
    f = rep["flags"]
    lines = [f"lengthwise serve ... {' '.join(f['serve'])}"]
    if "serve_placement" in f:
        lines.append(f"lengthwise serve --placement lengthwise ... {' '.join(f['serve_placement'])}   "
                     f"(placements {PROFILE_PLACEMENTS})")
    lines.append(f"lengthwise replay ... {' '.join(f['replay'])}")
    if "simulate" in f:
        lines.append(f"lengthwise simulate ... {' '.join(f['simulate'])}")
    return lines


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate", help="t_p, t_g and the step profile of your own model, printed as the flags serve/replay/simulate take",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Measure what a request alone costs on your engine (t_p: time to the first token, t_g: time per "
                    "later token, seconds) and, with --model, the engine's step profile; write OUT/calibration.json and "
                    "print the flags lengthwise serve, replay and simulate take. --url times lone requests against a "
                    "running OpenAI-compatible engine or gateway (lengthwise demo's calibration); --model runs a burst "
                    "through stock vLLM here with every step recorded and fits the simulator's step model to it "
                    "(lengthwise bench engine's calibration).")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--url", metavar="URL", help="a running OpenAI-compatible engine or gateway, e.g. http://gpu-0:8001")
    which.add_argument("--model", metavar="PATH",
                       help="a Hugging Face model directory or a GGUF (converted once into --model-cache): start an "
                            "engine here, run the burst, stop it")
    p.add_argument("--out", type=Path, default=Path("calibration"), metavar="DIR",
                   help="where calibration.json (and step_profile.csv) go (default: %(default)s)")
    p.add_argument("--requests", type=int, metavar="N",
                   help=f"prompts: sent one at a time with --url (default {URL_REQUESTS}), the burst with --model "
                        f"(default {MODEL_REQUESTS})")
    p.add_argument("--workload", metavar="FILE",
                   help="the prompts (ShareGPT or AlpacaEval; default: ShareGPT first turns in $LENGTHWISE_DATA)")
    p.add_argument("--slo-scale", type=float, default=2.0, metavar="S",
                   help="the SLO the flags carry: S x the lone-request times (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    u = p.add_argument_group("with --url")
    u.add_argument("--served-model", metavar="NAME", help="the model name to ask for (default: the first /v1/models lists)")
    u.add_argument("--tokens", type=int, default=32, metavar="N",
                   help="output tokens of each lone request (ignore_eos) (default: %(default)s)")
    u.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"),
                   help="the endpoint's key (default: $OPENAI_API_KEY; a flag shows in ps)")
    m = p.add_argument_group("with --model (the engine: as you will serve it)")
    m.add_argument("--max-tokens", type=int, default=512, metavar="N",
                   help="each request's cap: the max_tokens your clients send (default: %(default)s)")
    m.add_argument("--max-model-len", type=int, default=4096, metavar="N",
                   help="the engine's context; prompts with no room for --max-tokens are left out (default: %(default)s)")
    m.add_argument("--kv-blocks", type=int, default=1024, metavar="N",
                   help="KV pool in blocks of 32 tokens (default: %(default)s)")
    m.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="(default: %(default)s)")
    m.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N", help="(default: %(default)s)")
    m.add_argument("--threads", type=int, default=1, metavar="N", help="torch threads of a CPU engine (default: %(default)s)")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="the engine's share of the GPU for weights and activations (default: %(default)s)")
    m.add_argument("--cuda-graphs", action="store_true", help="vLLM's compiled model and CUDA graphs (a GPU; as served)")
    m.add_argument("--temperature", type=float, default=0.7, help="sampling, as served (default: %(default)s)")
    m.add_argument("--top-p", type=float, default=0.9, help="(default: %(default)s)")
    m.add_argument("--repetition-penalty", type=float, default=1.1, help="(default: %(default)s)")
    m.add_argument("--model-cache", type=Path, metavar="DIR",
                   help="where a GGUF is converted (default: ~/.cache/lengthwise/models)")
    p.set_defaults(func=run)
    return p


def _check(a: argparse.Namespace) -> None:
    for name in ("requests", "tokens", "max_tokens", "max_model_len", "kv_blocks", "max_num_seqs",
                 "max_num_batched_tokens", "threads"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise CalibrateError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if a.url is not None and a.tokens < 2:
        raise CalibrateError(f"--tokens must be at least 2 (t_g is timed between tokens), got {a.tokens}")
    if a.model is not None and a.requests is not None and a.requests < 4:
        raise CalibrateError(f"--requests must be at least 4 with --model (a step model needs steps), got {a.requests}")
    if not a.slo_scale > 0:
        raise CalibrateError(f"--slo-scale must be positive, got {a.slo_scale:g}")
    if a.workload and not Path(a.workload).expanduser().exists():
        raise CalibrateError(f"--workload {a.workload}: no such file")
    if a.url is not None and not a.url.startswith(("http://", "https://")):
        raise CalibrateError(f"--url {a.url}: not an http(s) URL, e.g. http://127.0.0.1:8001")


def _workload(a: argparse.Namespace) -> Path:
    from predictor.common import default_sharegpt

    w = Path(a.workload).expanduser() if a.workload else default_sharegpt()
    if not w.exists():
        raise CalibrateError(f"ShareGPT prompts not found at {w}; set LENGTHWISE_DATA or give --workload")
    return w


def by_url(a: argparse.Namespace) -> dict[str, Any]:
    """``--url``: lone requests timed as a client times them (:func:`serving.demo.calibrate`)."""
    from serving.bench.replay import ReplayError, default_tokenizer_for, plan_jobs, probe_endpoint
    from serving.demo import DemoError, calibrate

    url = a.url.rstrip("/").removesuffix("/v1")
    n = a.requests or URL_REQUESTS
    auth = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        listed, max_len = probe_endpoint(url, headers=auth)
        model = a.served_model or listed
        plan = plan_jobs(_workload(a), max_requests=n, max_tokens_cap=None, max_tokens=a.tokens, rate=None, seed=a.seed,
                         tokenizer=default_tokenizer_for(model), max_model_len=max_len)
        if len(plan.jobs) < n:
            raise CalibrateError(f"the workload holds {len(plan.jobs)} prompts that fit the context, not {n}")
        t_p, t_g, results = calibrate(url, model, plan.jobs, n, a.tokens, headers=auth)
    except (ReplayError, DemoError) as exc:
        raise CalibrateError(" ".join(str(exc).split())) from None
    how = {"method": "lone requests (lengthwise demo's calibration)", "url": url, "model": model, "requests": n,
           "tokens": a.tokens, "ttft_s": [r.ttft for r in results]}
    return report(t_p, t_g, a.slo_scale, how)


def by_model(a: argparse.Namespace) -> dict[str, Any]:
    """``--model``: a burst through stock vLLM here, the step model fitted (the engine bench's calibration)."""
    from pydantic import ValidationError
    from rich.console import Console

    from serving.argtypes import flag_error
    from serving.bench.engine.bench import EngineBenchConfig, EngineBenchError, calibrate_model
    from serving.launch.models import DEFAULT_MODEL_CACHE

    try:
        cfg = EngineBenchConfig(workload=str(_workload(a)), model=a.model, max_requests=a.requests or MODEL_REQUESTS,
                                max_tokens=a.max_tokens, max_model_len=a.max_model_len, kv_blocks=a.kv_blocks,
                                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                threads=a.threads, seed=a.seed, cuda_graphs=a.cuda_graphs,
                                gpu_memory_utilization=a.gpu_memory_utilization, slo_scale=a.slo_scale,
                                sampling={"temperature": a.temperature, "top_p": a.top_p,
                                          "repetition_penalty": a.repetition_penalty})
    except ValidationError as exc:
        raise CalibrateError(flag_error(exc)) from None
    work = (a.out / "work").resolve()  # absolute: the engine process runs from the repository's root
    work.mkdir(parents=True, exist_ok=True)
    cache = (a.model_cache or DEFAULT_MODEL_CACHE).expanduser()
    try:
        cal = calibrate_model(cfg, work, Console(stderr=True), cache, a.slo_scale)
    except (EngineBenchError, FileNotFoundError, ValueError) as exc:
        raise CalibrateError(" ".join(str(exc).split())) from None
    profile = a.out / "step_profile.csv"
    profile.write_text(cal.profile.read_text())
    how = {"method": "step profile of a burst through stock vLLM (lengthwise bench engine's calibration)",
           "model": cal.config.model, "requests": cal.served.get("requests"), "max_tokens": cal.config.max_tokens,
           "engine": {k: getattr(cal.config, k) for k in ("max_model_len", "kv_blocks", "max_num_seqs",
                                                          "max_num_batched_tokens", "threads", "cuda_graphs")},
           "sampling": cal.config.sampling.model_dump(), "work_dir": str(work)}
    return report(cal.slo.t_p, cal.slo.t_g, a.slo_scale, how, profile.resolve(), cal.latency.describe(), cal.served)


def run(a: argparse.Namespace) -> int:
    try:
        _check(a)
        a.out.mkdir(parents=True, exist_ok=True)
        rep = by_url(a) if a.url is not None else by_model(a)
    except (CalibrateError, OSError) as exc:
        print(f"lengthwise calibrate: error: {exc}", file=sys.stderr)
        return 2
    path = a.out / "calibration.json"
    path.write_text(json.dumps(rep, indent=1) + "\n")
    (a.out / ENV_FILE).write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in shell_env(rep).items()))
    print(f"t_p {rep['t_p_s'] * 1e3:.1f} ms to the first token of a request alone, t_g {rep['t_g_s'] * 1e3:.2f} ms per "
          f"later token ({rep['requests']} requests; {rep['method']})")
    lat = rep["step_model"]
    if lat:
        r2 = "n/a" if lat["r2"] is None else f"{lat['r2']:.3f}"
        print(f"step model: {lat['c0_s'] * 1e3:.2f} ms + {lat['c1_s_per_prefill_token'] * 1e6:.1f} µs/prefill token + "
              f"{lat['c2_s_per_decode_token'] * 1e6:.1f} µs/decode token + {lat['c3_s_per_kv_token'] * 1e9:.2f} ns/KV "
              f"token (R² {r2}, {lat['n_rows']} steps)")
    print(f"wrote {path}, {a.out / ENV_FILE}" + (f" and {rep['step_profile']}" if rep["step_profile"] else ""))
    print("pass them on:")
    for line in flag_lines(rep):
        print(f"  {line}")
    return 0
