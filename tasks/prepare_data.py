"""prepare_data stage: build the normalised train/test jsonl files.

Run alone: `posttrain prepare-data --preset tiny`.
"""

from __future__ import annotations

from pathlib import Path

from trainer import data as D
from trainer import storage
from trainer.config import RunConfig


def body(cfg: RunConfig, inputs: dict, ref, fault: dict):
    def compute(work: Path, logger) -> dict:
        from trainer.problems import task_of

        prepared = D.prepare(cfg.data, cfg.seed, task_of(cfg.task))
        sha256 = {  # the splits' content hashes: the digests of the MLflow datasets the stages log
            "train.jsonl": storage.write_jsonl(str(work / "train.jsonl"), prepared.train),
            "test.jsonl": storage.write_jsonl(str(work / "test.jsonl"), prepared.test),
        }
        report = {"n_train": len(prepared.train), "n_test": len(prepared.test),
                  "n_skipped": len(prepared.skipped), "skipped": prepared.skipped[:100]}
        storage.write_json(str(work / "report.json"), report)
        metrics = {"data/n_train": len(prepared.train), "data/n_test": len(prepared.test),
                   "data/n_skipped": len(prepared.skipped)}
        logger.log_metrics(metrics)
        logger.log_table([{"id": ex["id"], "messages": ex["messages"], "answer": ex["answer"]}
                          for ex in prepared.train[:20]], "data_samples.json")
        return {"metrics": metrics, "sha256": sha256}

    return compute


def load_split(manifest: dict, split: str) -> list[dict]:
    return storage.read_jsonl(storage.join(manifest["uri"], f"{split}.jsonl"))
