"""``predictor-sidecar`` on the command line: flags derived from the settings model, one-line errors, serve.

Every flag is a field of :class:`SidecarSettings` (name, type, default and help come from the field), so a
setting is defined in one place and the CLI cannot drift from what the app reads. Errors are one line and exit 2,
because operators read them in container logs; the port is bound before the model resolves, so a busy port fails
fast and a slow registry never holds it half-open.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import types
from typing import Literal, Union, get_args, get_origin

from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from predictor.sidecar.auth import TOKEN_ENV, TokenError, load_token
from predictor.sidecar.cache import ModelResolveError, parse_uri, prune, resolve
from predictor.sidecar.settings import SidecarSettings

log = logging.getLogger("predictor.sidecar")

# Where a field's flag appears in --help (fields not named here are general options); --help lists them in field order.
FLAG_GROUPS = {
    "batching and inference": ("max_batch", "max_wait_ms", "threads", "workers", "token_budget", "precision", "ort_spin",
                               "fast_tier", "spill_margin_ms", "max_body_bytes", "lru_size"),
    "authentication": ("token", "token_file", "protect_health"),
    "registry and online monitoring": ("reload_interval", "window_size", "window_seconds", "alarm_margin", "padding",
                                       "max_actual_tokens"),
    "feedback store (training data)": ("feedback_store", "feedback_db", "store_prompts", "feedback_max_rows",
                                       "feedback_max_age_days", "feedback_queue", "lru_mb"),
}
_METAVARS = {"model": "URI", "token": "TOKEN", "token_file": "PATH"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2: operators grep logs, not usage blocks
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def flag_name(field: str) -> str:
    """The command-line flag of a settings field: ``max_wait_ms`` -> ``--max-wait-ms``; a switch that is on by
    default is turned off: ``store_prompts`` -> ``--no-store-prompts``."""
    info = SidecarSettings.model_fields.get(field)
    on_by_default = info is not None and info.annotation is bool and info.default is True
    return ("--no-" if on_by_default else "--") + field.replace("_", "-")


def flag_type(field: FieldInfo) -> tuple[type, list | None]:
    """The argparse type and choices of a field: ``int | None`` -> int, ``Literal["a", "b"]`` -> (str, ["a", "b"]),
    a secret -> str (the settings wrap it)."""
    ann = field.annotation
    if get_origin(ann) in (Union, types.UnionType):
        ann = next(t for t in get_args(ann) if t is not type(None))
    if ann is SecretStr:
        return str, None
    if get_origin(ann) is Literal:
        choices = list(get_args(ann))
        return type(choices[0]), choices
    return ann, None


def _add_flag(group: argparse._ActionsContainer, name: str, field: FieldInfo) -> None:
    help_text = (field.description or "").replace("%", "%%")
    if field.annotation is bool:  # a switch: --ort-spin turns an off-by-default one on, --no-store-prompts one off
        group.add_argument(flag_name(name), dest=name, action="store_false" if field.default else "store_true",
                           default=field.default, help=help_text)
        return
    kind, choices = flag_type(field)
    if field.default is not None:
        help_text += " (default: %(default)s)"
    group.add_argument(flag_name(name), type=kind, default=field.default, choices=choices, metavar=_METAVARS.get(name),
                       help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """The ``predictor-sidecar`` parser: one flag per settings field, grouped as FLAG_GROUPS says."""
    p = _Parser(
        prog="predictor-sidecar", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve response-length predictions over HTTP beside the LLM engines: POST /v1/predict, "
                    "POST /v1/feedback (actual lengths -> online error in MLflow and Prometheus), GET /health, /ready, "
                    "/metrics, /openapi.json. Follows a registry alias and hot-swaps when it moves; restarts from "
                    "the local model cache when the registry is down.",
        epilog="examples:\n"
               "  predictor-sidecar                                    # models:/length-predictor@champion on 127.0.0.1:8100\n"
               "  predictor-sidecar --model models:/length-predictor@challenger --port 8101\n"
               "  predictor-sidecar --model models:/length-predictor/3 --reload-interval 0   # pin a version\n"
               "  curl -s localhost:8100/v1/predict -d '{\"prompt\": \"Write a haiku about autumn.\"}'\n"
               "  curl -s localhost:8100/v1/feedback -d '{\"request_id\": \"<prediction_id>\", \"actual_tokens\": 212}'\n\n"
               "  predictor-sidecar --token-file /run/secrets/sidecar-token   # the gateway: --predictor-token\n\n"
               "environment: LENGTHWISE_HOME (store and model cache), MLFLOW_TRACKING_URI (a real MLflow server), "
               f"LENGTHWISE_ORT_THREADS, {TOKEN_ENV} (the token, when neither --token nor --token-file is given)")
    groups = {title: p.add_argument_group(title) for title in FLAG_GROUPS}
    where = {name: groups[title] for title, names in FLAG_GROUPS.items() for name in names}
    for name, field in SidecarSettings.model_fields.items():
        _add_flag(where.get(name, p), name, field)
    return p


def _check(a: argparse.Namespace, p: argparse.ArgumentParser) -> SidecarSettings:
    """The settings the parsed flags give; a value out of range exits 2 with one line naming its flag."""
    try:
        return SidecarSettings(**{k: v for k, v in vars(a).items() if k in SidecarSettings.model_fields})
    except ValidationError as exc:
        field = str(exc.errors()[0]["loc"][0])
    if field == "port":
        p.error(f"--port must be between 1 and 65535, got {a.port}")
    p.error(f"{flag_name(field)} is out of range: {getattr(a, field)}")


def resolve_token(a: argparse.Namespace, p: argparse.ArgumentParser) -> str | None:
    """The token from --token, --token-file or $LENGTHWISE_SIDECAR_TOKEN (None: open); a token setting that cannot
    give one, or --protect-health without one, exits 2 with one line (which never shows the token)."""
    try:
        token = load_token(a.token, a.token_file)
    except TokenError as exc:
        p.error(str(exc))
    if token is None and a.protect_health:
        p.error(f"--protect-health needs a token (--token, --token-file or {TOKEN_ENV})")
    return token


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _configure_process(log_level: str) -> None:
    """Logging to stderr, and MLflow told to fail fast against a dead tracking server (its default retries for
    minutes); the model cache covers us."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # retry chatter; we log the outcome ourselves
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def main(argv: list[str] | None = None) -> int:
    """Parse and check the flags, bind the port, resolve the model (from the cache when the registry is down), serve."""
    p = build_parser()
    a = p.parse_args(argv)
    a.token = resolve_token(a, p)
    settings = _check(a, p)
    _configure_process(settings.log_level)
    try:
        sock = _listen(settings.host, settings.port)
    except (OSError, OverflowError) as exc:
        print(f"predictor-sidecar: error: cannot listen on {settings.host}:{settings.port}: "
              f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    try:
        ref = parse_uri(settings.model)
        resolved = resolve(ref)
        if ref.name is not None:
            prune(ref.name, settings.cache_versions, (resolved.version,))
    except ModelResolveError as exc:
        print(f"predictor-sidecar: error: {exc}", file=sys.stderr)
        sock.close()
        return 2
    import uvicorn  # the app's imports (FastAPI, uvicorn) are not needed for --help or a refused flag

    from predictor.sidecar.app import create_app

    app = create_app(settings, ref, resolved)
    config = uvicorn.Config(app, log_level=settings.log_level, access_log=False, timeout_graceful_shutdown=5)
    log.info("listening on http://%s:%d (model %s -> version %s)", settings.host, settings.port, ref.uri, resolved.version)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
