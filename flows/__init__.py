"""Prefect flows: the speedrun DAG and each stage runnable on its own."""
