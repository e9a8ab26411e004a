"""The engines' log formatter: the installed vLLM's own default one, however that release defines it.

The launcher (and the Kubernetes example's ConfigMap) hands each engine a logging ``dictConfig``: vLLM's
default plus the plug-in's ``serving`` loggers, so the plug-in's stats line reaches the engine log. Copying
vLLM's formatter entry into that config ties it to one release: 0.32's passes ``log_level`` to
``NewLineFormatter`` and formats a ``vllm_process_name`` field, and an engine of another release then
fails at import or on every log line. This factory builds the formatter from the running vLLM's own
``DEFAULT_LOGGING_CONFIG`` instead.
"""

from __future__ import annotations

import copy
import logging
import logging.config


def vllm_formatter() -> logging.Formatter:
    """vLLM's ``DEFAULT_LOGGING_CONFIG["formatters"]["vllm"]``, built as ``dictConfig`` builds it."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG  # defined before vllm.logger applies a config that names us

    spec = copy.deepcopy(DEFAULT_LOGGING_CONFIG["formatters"]["vllm"])
    return logging.config.DictConfigurator({}).configure_formatter(spec)
