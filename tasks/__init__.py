"""Prefect tasks: one per pipeline stage, wrapping trainer/ with caching and MLflow tracking."""

import logging
import os
import sys

# PREFECT_LOGGING_EXTRA_LOGGERS=trainer (set by the CLI and `make serve`'s worker) hands Prefect's
# API handler to the ML core's logger but no level: at the root's WARNING its progress lines and
# notices (resumed from a checkpoint, which engine generates) never reached a flow run's log.
if logging.getLogger("trainer").level == logging.NOTSET:
    logging.getLogger("trainer").setLevel(logging.INFO)

# Off a terminal (a worker, a log file) transformers', datasets' and MLflow's bars ("Loading weights",
# "Writing model shards", "Generating train split", "Downloading artifacts" of a models:/ start) are
# carriage-return debris in the log; the stages say their own progress there (trainer/progress.py).
# Ranks inherit the setting through the environment; a library already imported is told directly
# (transformers and datasets read it once, at import; MLflow at each download).
if not sys.stderr.isatty():
    for _var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(_var, "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from transformers.utils import logging as _hf_logging

        _hf_logging.disable_progress_bar()
    if "datasets" in sys.modules and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1":
        import datasets as _datasets

        _datasets.disable_progress_bars()
