"""Prefect tasks: one per pipeline stage, wrapping trainer/ with caching and MLflow tracking."""

import logging
import os
import sys

# PREFECT_LOGGING_EXTRA_LOGGERS=trainer (set by the CLI and `make serve`'s worker) hands Prefect's
# API handler to the ML core's logger but no level: at the root's WARNING its progress lines and
# notices (resumed from a checkpoint, which engine generates) never reached a flow run's log.
if logging.getLogger("trainer").level == logging.NOTSET:
    logging.getLogger("trainer").setLevel(logging.INFO)

# Off a terminal (a worker, a log file) transformers' bars ("Loading weights", "Writing model
# shards") are carriage-return debris in the log; the stages say their own progress there
# (trainer/progress.py). Ranks inherit the setting through the environment.
if not sys.stderr.isatty():
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # it reads the setting once, at import
        from transformers.utils import logging as hf_logging

        if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
            hf_logging.disable_progress_bar()
