"""Prefect tasks: one per pipeline stage, wrapping trainer/ with caching and MLflow tracking."""

import logging

# PREFECT_LOGGING_EXTRA_LOGGERS=trainer (set by the CLI and `make serve`'s worker) hands Prefect's
# API handler to the ML core's logger but no level: at the root's WARNING its progress lines and
# notices (resumed from a checkpoint, which engine generates) never reached a flow run's log.
if logging.getLogger("trainer").level == logging.NOTSET:
    logging.getLogger("trainer").setLevel(logging.INFO)
