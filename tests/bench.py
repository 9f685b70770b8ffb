"""`make bench`: throughput and per-round timing of the tiny preset on this machine.

Prints a table and writes bench-results/bench.json. Figures, not assertions: quote them.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from trainer.config import load_config
from trainer.data import synthetic
from trainer.model import build_model, count_params
from trainer.tokenizer import train_tokenizer


def main() -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    from trainer.chat import encode_prompt
    from trainer.grpo import GRPOTrainer
    from trainer.rollout import HFEngine, SamplingParams
    from trainer.sft import train_sft

    out: dict[str, float] = {}
    cfg = load_config("tiny", ["sft.max_steps=40", "sft.warmup_steps=5", "grpo.rounds=8", "grpo.eval_every=1000",
                               "grpo.checkpoint_every=1000"])
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 4000, "n_test": 200}), 0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tok = train_tokenizer((m["content"] for ex in data.train for m in ex["messages"]), 384, Path(tmp) / "tok")
        out["tokenizer_seconds"] = time.perf_counter() - t0
        model = build_model(cfg.model, tok, 0)
        out["params"] = count_params(model)
        engine, res = train_sft(cfg, model, tok, data.train, Path(tmp) / "sft")
        out["sft_tokens_per_second"] = res.tokens_per_second
        out["sft_seconds_per_step"] = res.train_seconds / res.steps

        prompts = [encode_prompt(tok, ex["messages"][:-1]) for ex in data.test[:64] for _ in range(8)]
        hf = HFEngine(engine.module, tok, 512)
        t0 = time.perf_counter()
        gens = hf.generate(prompts, SamplingParams(48, 1.0, 1.0, seed=0))
        secs = time.perf_counter() - t0
        out["rollout_tokens_per_second"] = sum(len(g.token_ids) for g in gens) / secs
        out["rollout_seconds_512_samples"] = secs

        trainer = GRPOTrainer(cfg, engine.module, tok, data.train, data.test, Path(tmp) / "grpo")
        rounds = []
        while not trainer.done():
            b = trainer.score(trainer.rollout())
            trainer.update(b)
            trainer.sync()
            rounds.append(trainer.history[-1])
        for k in ("generate", "reward", "update", "sync", "round"):
            out[f"grpo_{k}_seconds_median"] = statistics.median(r.get(f"time/{k}_seconds", 0.0) for r in rounds)
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/bench.json").write_text(json.dumps(out, indent=2))
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v:,.3f}" if isinstance(v, float) else f"{k:<{width}}  {v:,}")


if __name__ == "__main__":
    main()
