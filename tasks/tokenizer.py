"""tokenizer stage (from-scratch presets): train a BPE tokenizer on the prepared train text.

Run alone: `posttrain tokenizer --preset tiny`.
"""

from __future__ import annotations

from pathlib import Path

from tasks.prepare_data import load_split
from trainer import storage


def body(cfg, inputs: dict, ref, fault: dict):
    def compute(work: Path, logger) -> dict:
        from trainer.tokenizer import train_tokenizer as train_bpe  # transformers: only when it runs

        train = load_split(inputs["data"], "train")
        texts = (m["content"] for ex in train for m in ex["messages"])
        tok = train_bpe(texts, cfg.tokenizer.vocab_size, work / "tokenizer", cfg.tokenizer.added_tokens)
        sample = train[0]["messages"]
        ids = tok.apply_chat_template(sample, tokenize=False)
        n_tokens = len(tok(ids, add_special_tokens=False)["input_ids"])
        metrics = {"tokenizer/vocab_size": len(tok), "tokenizer/sample_tokens": n_tokens}
        logger.log_metrics(metrics)
        return {"metrics": metrics, "tokenizer_subdir": "tokenizer"}

    return compute


def tokenizer_dir(manifest: dict) -> Path:
    # the source run: which computation of that folder (a recompute at the same URL is a new download)
    return storage.local_dir(storage.join(manifest["uri"], manifest["tokenizer_subdir"]),
                             version=manifest.get("source_run_id"))
