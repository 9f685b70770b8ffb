"""Prefect tasks: one per pipeline stage, wrapping trainer/ with caching and MLflow tracking."""
