"""posttrain's ML core: configs, data, tokenizer, models, DeepSpeed SFT/GRPO, evaluation.

Imports nothing from Prefect or MLflow; tracking goes through `trainer.tracking.MetricLogger`.
"""
