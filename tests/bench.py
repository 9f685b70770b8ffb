"""`make bench`: posttrain against TRL on the same GRPO work, SFT against a plain PyTorch loop,
and what the pipeline adds around a GRPO round. Figures, not assertions: quote them.

1. The machine: fp32 GFLOP/s of a large matmul (the ceiling every figure below is measured against).
2. GRPO, side by side (`tests/bench_ref.py`): TRL's GRPOTrainer and posttrain's on the reference
   workload (issue 14), with KL on (beta 0.04), on a larger shape, and on the real SmolLM2-135M-Instruct
   (issue 31's targets: step <= 0.4 of TRL's, generation >= 2x its tokens/s). Each session is its own
   process (its peak RSS is its own) and the tools alternate, A B A B, so drift hits both.
   TRL runs at its fastest: `gradient_checkpointing=False` (its default is on, which recomputes
   the forward; posttrain does not checkpoint activations). Beside each shape: a lower bound from
   its linear layers' matrix products alone, timed at their own shapes, against the targets.
3. SFT: `train_sft` against a plain PyTorch loop (AdamW, the same model, batches and schedule; the
   loop pads each batch). posttrain runs twice: as it trains (`sft.packing`, rows of examples end to
   end, no padding computed) and padded like the loop (what the training loop itself costs).
4. The pipeline: a real `posttrain speedrun` (Prefect, MLflow on SQLite) on a small config: the
   seconds of each GRPO round spent outside the trainer, and the wall time of a fully cached re-run.
5. Async rounds (`rollout.async_steps` 0, 1, 2): `posttrain grpo` on the tiny preset (its SFT from
   cache after the first), with the HF engine and with an SGLang CPU server: GRPO rounds per minute
   and generated tokens/s over rounds 2..20. Sync and async get the same two cores: the trainer
   pinned to core 0 (one thread), the rollout process or the server to core 1; the unpinned sync
   run (two threads, both phases) is beside them. `rollout.over_sample=1`, so that every row
   generates the same prompts per round (async rounds drop the over-sampled surplus that sync
   rounds carry over). The pinned rows run twice (0 1 2, then 2 1 0), each pass against its own
   sync row, so that the machine's drift shows.

6. PPO against GRPO (`grpo.advantage` gae / group): the tiny preset's GRPO rounds on its model
   (random init, a dense reward so the critic has values to learn), each mode in its own process,
   alternating A B A B: the update's seconds per round (median of rounds 2..6; PPO's includes the
   critic's value pass and steps) and the process's peak RSS.

7. LoRA against full fine-tuning (`model.lora.rank` 1, 8, 32): the smollm2-135m preset's GRPO rounds
   on its real weights (a dense reward, no filtering: 32 samples a round), each in its own process:
   the update's seconds (median of rounds 2..3), the trainable parameters and the peak RSS; then full
   and rank 8 again with `grpo.gradient_checkpointing` (each against the full run at its setting).

8. The in-process decoders (`--only decode`, not in the full run): SmolLM2-135M-Instruct's real
   weights, on the GPU when there is one (16 prompts x 8 samples x 128 tokens; on CPU 4 x 4 x 32),
   every row decoding the same number of tokens (EOS held back), sampled at T = 1: HF `generate`,
   the fixed-shape decoder stepped eagerly, and on CUDA replayed from its CUDA graphs, on CPU the
   compiled decoder; tokens/s of the median of two calls after a first (which captures).

9. Policy-written code (`--only sandbox`): executions/s through trainer.problems.sandbox on the
   2 cores, one and two at a time, against a bare `python -I -S` process (the cost of isolation).

10. GSM8K-length answers (`--only long`, also in the full run): posttrain and TRL on SmolLM2's real
   weights at 32 and 256 new tokens, 16 sequences a step: generation tokens/s, the update's ms per
   token and the peak RSS per token at each, and how each grows from 32 to 256 tokens.

On a GPU (`torch.cuda.is_available()`), `make bench` runs instead: the GPU table (`--only gpu`,
issue 43): `tests/bench_ref.py`'s `smollm2-gpu` shape (SmolLM2-135M, 16 prompts x 8 samples x 128
tokens, 4 steps measured after 1), each session its own process: TRL's GRPOTrainer with plain
`generate` (fp32, bf16) and with transformers' continuous batching, posttrain as it ships
(deterministic; fp32, bf16) and with POSTTRAIN_DETERMINISTIC=0; step, generation tok/s, update, weight
sync and peak GPU memory, each against TRL at its precision, and the floors at the GPU's own
measured copy bandwidth and matmul rates; then part 8 on the GPU.

Prints tables and writes bench-results/bench.json. `python -m tests.bench --quick` skips 4, 5, 7 and
the larger shape; `--only async` runs 5 alone, `--only ppo` 6, `--only lora` 7, `--only decode` 8,
`--only gpu` the GPU table, `--only sandbox` 9, `--only long` 10.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench_ref import SHAPES, Shape


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def layer_linears(shape: Shape) -> list[list[tuple[int, int]]]:
    """One decoder layer's linear weights as (in, out), grouped as a fused kernel could take them:
    q/k/v, o, gate/up, down."""
    h, inter = shape.hidden, shape.intermediate
    kv = shape.kv_heads * (h // shape.heads)
    return [[(h, h), (h, kv), (h, kv)], [(h, h)], [(h, inter), (h, inter)], [(inter, h)]]


def step_gflop(shape: Shape) -> dict[str, float]:
    """FLOPs of one step of the workload: generation (prefill + decode, every sample its own
    prompt) and training (forward + backward = 3 forwards, plus the reference forward with KL)."""
    h, L = shape.hidden, shape.layers
    matmul_params = L * sum(k * n for group in layer_linears(shape) for k, n in group) + h * shape.vocab

    def forward(tokens: int, ctx: float) -> float:
        return tokens * (2 * matmul_params + 4 * L * ctx * h)

    n, P, T = shape.batch, shape.prompt_tokens, shape.new_tokens
    gen = forward(n * P, P / 2) + forward(n * T, P + T / 2)
    train = forward(n * (P + T), (P + T) / 2) * (3 + (1 if shape.kl else 0))
    return {"generation": gen / 1e9, "training": train / 1e9, "total": (gen + train) / 1e9}


def linear_floor(shape: Shape, reps: int = 7) -> dict[str, float]:
    """A lower bound on a step's seconds: its linear layers' matrix products alone, each timed at its
    own shape on this machine as the faster of torch.mm and posttrain's compiled product of that
    layout (`trainer/csrc/gemm.cpp`: forward, input gradient, weight gradient), weights in cache.
    Everything else (attention, norms, sampling, the optimizer, reading the weights from memory)
    counts as free; q/k/v and gate/up may be fused wherever that is faster; a group's samples share
    one prompt pass (prefill and training) and the log-prob passes skip each sample's last token. A
    target below it cannot be met here by any arrangement of the same fp32 math with these products."""
    import torch

    from trainer import kernels

    torch.set_num_threads(2)
    ops = kernels.ops()
    seconds: dict[tuple, float] = {}

    def best_of(key: tuple, fns) -> float:
        if key not in seconds:
            m, k, n = key[1:]
            calls = max(1, int(2e6 // (m * k * n // 64 + 1)))  # small products repeated, past the clock
            best = float("inf")
            for f in fns:
                f()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    best = min(best, (time.perf_counter() - t0) / calls)
            seconds[key] = best
        return seconds[key]

    def mm(m: int, k: int, n: int) -> float:  # (m x k) @ (k x n), as a forward: y = x W^T
        if ("fwd", m, k, n) in seconds:
            return seconds[("fwd", m, k, n)]
        x, w = torch.randn(m, k), torch.randn(n, k)
        wt = w.T.contiguous()
        fns = [lambda: x @ w.T, lambda: x @ wt] + ([lambda: ops.linear_fwd(x, w, None)] if ops else [])
        return best_of(("fwd", m, k, n), fns)

    def grads(m: int, k: int, n: int) -> float:  # the input's and the weight's gradient of y = x W^T
        if ("dw", m, k, n) in seconds:
            return seconds[("dx", m, k, n)] + seconds[("dw", m, k, n)]
        x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        dx = best_of(("dx", m, k, n), [lambda: dy @ w] + ([lambda: ops.linear_dx(dy, w)] if ops else []))
        dw = best_of(("dw", m, k, n), [lambda: dy.T @ x] + ([lambda: ops.linear_dw(dy, x)] if ops else []))
        return dx + dw

    h, groups = shape.hidden, layer_linears(shape)

    def fastest(m: int, group: list[tuple[int, int]], cost) -> float:
        fused = (group[0][0], sum(n for _, n in group))
        return min(cost(m, *fused), sum(cost(m, k, n) for k, n in group))

    vocab = shape.vocab

    def forward(rows: int, head_rows: int) -> float:
        return shape.layers * sum(fastest(rows, g, mm) for g in groups) + mm(head_rows, h, vocab)

    def backward(rows: int, head_rows: int) -> float:
        return shape.layers * sum(fastest(rows, g, grads) for g in groups) + grads(head_rows, h, vocab)

    n, P, T = shape.batch, shape.prompt_tokens, shape.new_tokens
    generation = forward(shape.prompts * P, shape.prompts) + (T - 1) * forward(n, n)
    rows, head_rows = shape.prompts * P + n * (T - 1), n * T
    update = forward(rows, head_rows) * (2 if shape.kl else 1) + backward(rows, head_rows)
    return {"generation": generation, "update": update, "step": generation + update}


def session(tool: str, shape: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-m", "tests.bench_ref", "--tool", tool, "--shape", shape],
                         capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"bench session {tool}/{shape} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[6:])


def grpo_side_by_side(shapes: list[str], reps: dict[str, int], gflops: float) -> dict:
    results: dict[str, dict] = {}
    for shape in shapes:
        runs: dict[str, list[dict]] = {"trl": [], "posttrain": []}
        for _ in range(reps[shape]):
            for tool in ("trl", "posttrain"):  # A B A B
                r = session(tool, shape)
                print(f"  {shape:<7} {tool:<9} step {r['step']:.3f}s  generation {r['generate']:.3f}s "
                      f"({r['gen_tokens_per_second']:,.0f} tok/s)  update {r['update']:.3f}s  "
                      f"peak RSS {r['peak_rss_mib']:,.0f} MiB", flush=True)
                runs[tool].append(r)
        flop = step_gflop(SHAPES[shape])
        floor = flop["total"] / gflops
        linear = linear_floor(SHAPES[shape])
        agg = {}
        for tool, rs in runs.items():
            agg[tool] = {k: statistics.median(r[k] for r in rs)
                         for k in ("step", "generate", "update", "reward", "gen_tokens_per_second", "peak_rss_mib")}
            agg[tool]["decoder"] = rs[0]["decoder"]
            agg[tool]["floor_fraction"] = floor / agg[tool]["step"]
            agg[tool]["sessions"] = [{k: v for k, v in r.items() if k != "raw"} for r in rs]
        p, t = agg["posttrain"], agg["trl"]
        agg["ratios"] = {"step": p["step"] / t["step"], "generation_tokens_per_second": p["gen_tokens_per_second"]
                         / t["gen_tokens_per_second"], "update": p["update"] / t["update"],
                         "peak_rss": p["peak_rss_mib"] / t["peak_rss_mib"]}
        agg["gflop_per_step"], agg["floor_seconds"] = flop, floor
        agg["linear_floor_seconds"] = linear
        # issue 14's targets on the random-init shapes, issue 31's on the real model
        step_goal, gen_goal = (0.4, 2.0) if SHAPES[shape].pretrained else (0.5, 2.5)
        agg["targets_seconds"] = {"step": t["step"] * step_goal, "generation": t["generate"] / gen_goal,
                                  "step_ratio": step_goal, "generation_speedup": gen_goal}
        results[shape] = agg
    return results


# ---------------------------------------------------------------- SFT against a plain loop

def sft_against_plain_loop(steps: int = 60, reps: int = 2) -> dict:
    """The tiny preset's model and batches: train_sft's tokens/s against a plain PyTorch loop's."""
    import logging

    import torch
    from transformers import get_cosine_schedule_with_warmup

    from trainer.config import load_config
    from trainer.data import synthetic
    from trainer.model import build_model
    from trainer.sft import collate, encode_dataset, epoch_order, masked_lm_loss, target_tokens, train_sft
    from trainer.tokenizer import train_tokenizer

    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(2)
    cfg = load_config("tiny", [f"sft.max_steps={steps}", "sft.checkpoint_every=100000", "sft.log_every=100000"])
    s = cfg.sft
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 4000, "n_test": 10}), 0)
    out: dict[str, list[float]] = {"posttrain": [], "posttrain_padded": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer((m["content"] for ex in data.train for m in ex["messages"]), cfg.tokenizer.vocab_size,
                              Path(tmp) / "tok")
        encoded, _ = encode_dataset(tok, data.train, s.max_length)
        for rep in range(reps):
            for key, run_cfg in (("posttrain", cfg), ("posttrain_padded", cfg.model_copy(
                    update={"sft": s.model_copy(update={"packing": False})}))):
                model = build_model(cfg.model, tok, 0)
                _, res = train_sft(run_cfg, model, tok, data.train, Path(tmp) / f"{key}{rep}")
                out[key].append(res.tokens_per_second)

            model = build_model(cfg.model, tok, 0).train()
            opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
            sched = get_cosine_schedule_with_warmup(opt, s.warmup_steps, steps)
            order, pos, tokens = epoch_order(len(encoded), cfg.seed, 0), 0, 0
            t0 = time.perf_counter()
            for _ in range(steps):
                batch = collate([encoded[i] for i in order[pos:pos + s.micro_batch_size]], tok.pad_token_id)
                n = sum(target_tokens(encoded[i]) for i in order[pos:pos + s.micro_batch_size])
                pos += s.micro_batch_size
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = masked_lm_loss(logits, batch["input_ids"], batch["loss_mask"], n)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                loss.item()
                tokens += int(batch["attention_mask"].sum())
            out["plain"].append(tokens / (time.perf_counter() - t0))
            print(f"  SFT rep {rep + 1}: posttrain {out['posttrain'][-1]:,.0f} tok/s (packed), "
                  f"{out['posttrain_padded'][-1]:,.0f} (padded), plain loop {out['plain'][-1]:,.0f} tok/s", flush=True)
    p, pp, q = (statistics.median(out[k]) for k in ("posttrain", "posttrain_padded", "plain"))
    return {"steps": steps, "posttrain_tokens_per_second": p, "posttrain_padded_tokens_per_second": pp,
            "plain_loop_tokens_per_second": q, "ratio": p / q, "padded_ratio": pp / q, "runs": out}


# ---------------------------------------------------------------- the pipeline around a round

PIPELINE_SETTINGS = [
    "data.synthetic.n_train=2000", "data.synthetic.n_test=100", "sft.max_steps=30", "sft.checkpoint_every=1000",
    "grpo.rounds=12", "grpo.eval_every=1000", "grpo.checkpoint_every=1000", "grpo.sample_table_every=1000",
    "grpo.eval_examples=50", "grpo.pass_k=1", "eval.max_examples=100", "eval.seen_examples=0",
    "control.enabled=false",
]


def pipeline_overhead() -> dict:
    """A real speedrun on a small config, twice: per GRPO round, the flow's wall time between two
    rounds' ends less the trainer's own seconds (generate + reward + update + sync); then the
    whole command's wall time when every stage is a cache hit."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "PREFECT_HOME": f"{tmp}/prefect",
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "flows.cli", "speedrun", "--preset", "tiny",
               "--set", f"artifact_root={tmp}/artifacts"]
        for s in PIPELINE_SETTINGS:
            cmd += ["--set", s]
        walls = []
        for _ in range(2):
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            walls.append(time.perf_counter() - t0)
            if out.returncode != 0:
                raise RuntimeError(f"pipeline run failed (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        history = next(Path(tmp, "artifacts").rglob("history.jsonl"))
        rounds = [json.loads(x) for x in history.read_text().splitlines()]
    gaps = []
    for prev, cur in zip(rounds, rounds[1:]):
        if "eval/accuracy" in prev:  # the eval after that round falls in this gap
            continue
        gaps.append((cur["time/grpo_elapsed"] - prev["time/grpo_elapsed"], cur["time/round_seconds"]))
    outside = statistics.median(w - r for w, r in gaps)
    inside = statistics.median(r for _, r in gaps)
    return {"rounds_measured": len(gaps), "round_seconds_in_trainer": inside, "round_seconds_outside_trainer": outside,
            "outside_fraction": outside / (inside + outside), "first_run_seconds": walls[0],
            "cached_rerun_seconds": walls[1]}


ASYNC_SETTINGS = ["rollout.over_sample=1", "grpo.rounds=20", "grpo.eval_every=100", "grpo.checkpoint_every=100",
                  "grpo.pass_k=1", "eval.seen_examples=0", "control.enabled=false"]
ASYNC_STEPS = (0, 1, 2)
STANDIN = Path(__file__).resolve().parent / "sglang_cpu"  # the test-only sgl_kernel stand-in (tests/test_sglang_server.py)


def async_rounds() -> dict:
    """GRPO rounds per minute and generated tokens/s for async_steps 0, 1, 2, HF engine and SGLang
    (one CPU server), pinned as the module docstring says; one `posttrain grpo` run per row and pass.

    The pinned rows run twice, in the order 0 1 2 then 2 1 0: each pass's async rows are compared
    with its own synchronous row, so a machine whose speed drifts over the minutes a pass takes
    (seen: one row 0.89x in a run and 1.42x alone an hour later) shows as two ratios that disagree,
    and a steady drift cancels in their mean."""
    sglang = ["rollout.engine=sglang", "rollout.sglang.device=cpu", f"rollout.sglang.env={{PYTHONPATH: {STANDIN}}}"]
    runs = []
    for engine, extra in (("hf", []), ("sglang", sglang)):
        core1 = extra + ["rollout.worker_cpus=[1]" if engine == "hf" else "rollout.sglang.cpus=[1]"]
        runs += [(engine, 0, False, 0, extra)]
        runs += [(engine, k, True, 0, core1) for k in ASYNC_STEPS]
        runs += [(engine, k, True, 1, core1) for k in reversed(ASYNC_STEPS)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine, k, pinned, rep, extra in runs:
            env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db", "PREFECT_HOME": f"{tmp}/prefect",
                   "TOKENIZERS_PARALLELISM": "false"}
            if pinned:
                env["OMP_NUM_THREADS"] = "1"
            cmd = [sys.executable, "-m", "flows.cli", "grpo", "--preset", "tiny", "--json", f"{tmp}/r.json",
                   "--set", f"artifact_root={tmp}/artifacts", "--set", f"rollout.async_steps={k}",
                   "--recompute", "grpo"]  # pinning is not in the stage's key: every row runs
            for s in ASYNC_SETTINGS + extra:
                cmd += ["--set", s]
            pin = (lambda: os.sched_setaffinity(0, {0})) if pinned else None
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, preexec_fn=pin)
            if proc.returncode != 0:
                raise RuntimeError(f"async bench run failed ({engine}, async_steps={k}):\n{proc.stdout[-3000:]}\n"
                                   f"{proc.stderr[-3000:]}")
            result = json.loads(Path(f"{tmp}/r.json").read_text())
            grpo = next(s for s in result["stages"] if s["stage"] == "grpo")
            rounds = [json.loads(x) for x in (Path(grpo["uri"]) / "history.jsonl").read_text().splitlines()][1:]
            wall = sum(h["time/round_wall_seconds"] for h in rounds)
            row = {"engine": engine, "async_steps": k, "pinned": pinned, "pass": rep, "rounds": len(rounds),
                   "rounds_per_minute": 60 * len(rounds) / wall,
                   "tokens_per_second": sum(h["rollout/generated_tokens"] for h in rounds) / wall,
                   "queue_wait_seconds": statistics.fmean(h.get("rollout/queue_wait_seconds", 0.0) for h in rounds),
                   "update_seconds": statistics.fmean(h["time/update_seconds"] for h in rounds),
                   "generate_seconds": statistics.fmean(h["time/generate_seconds"] for h in rounds),
                   "last_reward": rounds[-1]["reward/mean"]}
            print(f"  {engine:<7} async_steps={k} {'pinned' if pinned else 'unpinned'} (pass {rep + 1}): "
                  f"{row['rounds_per_minute']:.1f} rounds/min, {row['tokens_per_second']:,.0f} tok/s", flush=True)
            out.append(row)
    for r in out:
        base = next(b for b in out if b["engine"] == r["engine"] and b["async_steps"] == 0 and b["pinned"]
                    and b["pass"] == r["pass"])
        r["vs_pinned_sync"] = r["rounds_per_minute"] / base["rounds_per_minute"]
    return {"rows": _async_table(out), "runs": out}


def _async_table(runs: list[dict]) -> list[dict]:
    """One row per (engine, async_steps, pinned): the means over its passes, and each pass's ratio
    to that pass's pinned synchronous row (`vs_sync_passes`)."""
    rows = []
    for key in dict.fromkeys((r["engine"], r["async_steps"], r["pinned"]) for r in runs):
        same = [r for r in runs if (r["engine"], r["async_steps"], r["pinned"]) == key]
        row = {name: statistics.fmean(r[name] for r in same) for name in
               ("rounds_per_minute", "tokens_per_second", "queue_wait_seconds", "update_seconds",
                "generate_seconds", "vs_pinned_sync")}
        row.update(engine=key[0], async_steps=key[1], pinned=key[2], passes=len(same),
                   vs_sync_passes=[r["vs_pinned_sync"] for r in same])
        rows.append(row)
    return rows


# ---------------------------------------------------------------- PPO against GRPO

PPO_ROUNDS = 6


def ppo_session(mode: str) -> None:
    """One process: PPO_ROUNDS rounds of the tiny preset's GRPO stage (grpo.advantage=`mode`, no
    warm-up) on a random-init model; prints a BENCH line."""
    import resource

    import torch

    from trainer.config import load_config
    from trainer.data import synthetic
    from trainer.grpo import GRPOTrainer
    from trainer.loop import run_round
    from trainer.model import build_model
    from trainer.tokenizer import train_tokenizer

    torch.set_num_threads(2)
    cfg = load_config("tiny", [f"grpo.advantage={mode}", "grpo.critic.warmup_rounds=0", "grpo.eval_every=1000",
                               "grpo.checkpoint_every=1000", "grpo.rewards=[{name: tests.test_multirank.digit_share}]",
                               "rollout.dynamic_filter=none"])
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 2000, "n_test": 10}), 0)
    with tempfile.TemporaryDirectory() as d:
        tok = train_tokenizer([m["content"] for ex in data.train for m in ex["messages"]], cfg.tokenizer.vocab_size,
                              Path(d) / "tok")
        trainer = GRPOTrainer(cfg, build_model(cfg.model, tok, 0), tok, data.train, data.test, Path(d) / "grpo")
        for _ in range(PPO_ROUNDS):
            run_round(trainer)
    upd = [h["time/update_seconds"] for h in trainer.history[1:]]
    print("BENCH " + json.dumps({"mode": mode, "update_seconds": statistics.median(upd),
                                 "generate_seconds": statistics.median(h["time/generate_seconds"] for h in trainer.history[1:]),
                                 "samples": trainer.history[-1]["update/samples"],
                                 "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


def ppo_against_grpo(reps: int = 2) -> dict:
    runs: dict[str, list[dict]] = {"group": [], "gae": []}
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    for _ in range(reps):
        for mode in ("group", "gae"):  # A B A B
            out = subprocess.run([sys.executable, "-m", "tests.bench", "--ppo-session", mode], capture_output=True,
                                 text=True, env=env, timeout=1800)
            line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
            if out.returncode != 0 or line is None:
                raise RuntimeError(f"ppo session {mode} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            r = json.loads(line[6:])
            print(f"  {mode:<6} update {r['update_seconds']:.3f}s  generation {r['generate_seconds']:.3f}s  "
                  f"peak RSS {r['peak_rss_mib']:,.0f} MiB", flush=True)
            runs[mode].append(r)
    agg = {m: {k: statistics.median(r[k] for r in rs) for k in ("update_seconds", "generate_seconds", "peak_rss_mib")}
           for m, rs in runs.items()}
    agg["samples_per_round"] = runs["gae"][0]["samples"]
    agg["ratios"] = {"update": agg["gae"]["update_seconds"] / agg["group"]["update_seconds"],
                     "peak_rss": agg["gae"]["peak_rss_mib"] / agg["group"]["peak_rss_mib"]}
    return agg


# ---------------------------------------------------------------- LoRA against full fine-tuning

LORA_ROUNDS = 3
# full fine-tuning, then LoRA at these ranks; "+ckpt": with grpo.gradient_checkpointing
LORA_MODES = ("full", "1", "8", "32", "full+ckpt", "8+ckpt")


def lora_session(mode: str) -> None:
    """One process: LORA_ROUNDS GRPO rounds of the smollm2-135m preset (real weights; dense reward
    so that no group is filtered and every round trains 32 samples), full fine-tuning or LoRA at
    rank `mode`; prints a BENCH line."""
    import resource

    import torch

    from trainer.config import load_config
    from trainer.data import synthetic
    from trainer.grpo import GRPOTrainer
    from trainer.loop import run_round
    from trainer.model import build_model
    from trainer.tokenizer import load_tokenizer
    from trainer.model import resolve_pretrained

    overrides = ["grpo.eval_every=1000", "grpo.checkpoint_every=1000", "rollout.dynamic_filter=none",
                 "rollout.over_sample=1", "grpo.rewards=[{name: tests.test_multirank.digit_share}]"]
    rank, _, ckpt = mode.partition("+")
    if rank != "full":
        overrides += [f"model.lora.rank={rank}", "grpo.lr=3e-4"]
    overrides.append(f"grpo.gradient_checkpointing={str(ckpt == 'ckpt').lower()}")
    cfg = load_config("smollm2-135m", overrides)
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 200, "n_test": 10}), 0)
    tok = load_tokenizer(resolve_pretrained(cfg.model.pretrained))
    with tempfile.TemporaryDirectory() as d:
        trainer = GRPOTrainer(cfg, build_model(cfg.model, tok, 0), tok, data.train, data.test, Path(d) / "grpo")
        for _ in range(LORA_ROUNDS):
            run_round(trainer)
        trainable = sum(p.numel() for p in trainer.ds.module.parameters() if p.requires_grad)
    rest = trainer.history[1:]
    print("BENCH " + json.dumps({"mode": mode, "update_seconds": statistics.median(h["time/update_seconds"] for h in rest),
                                 "generate_seconds": statistics.median(h["time/generate_seconds"] for h in rest),
                                 "tokens": statistics.median(h["update/trained_tokens"] for h in rest),
                                 "samples": trainer.history[-1]["update/samples"], "trainable_params": trainable,
                                 "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


def lora_against_full() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    rows = {}
    for mode in LORA_MODES:
        out = subprocess.run([sys.executable, "-m", "tests.bench", "--lora-session", mode], capture_output=True,
                             text=True, env=env, timeout=3600)
        line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
        if out.returncode != 0 or line is None:
            raise RuntimeError(f"lora session {mode} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
        r = rows[mode] = json.loads(line[6:])
        print(f"  {mode:<5} update {r['update_seconds']:.3f}s  generation {r['generate_seconds']:.3f}s  "
              f"trainable {r['trainable_params']:,}  peak RSS {r['peak_rss_mib']:,.0f} MiB", flush=True)
    for mode, r in rows.items():
        full = rows["full+ckpt" if mode.endswith("+ckpt") else "full"]  # against full fine-tuning at its setting
        r["update_vs_full"] = r["update_seconds"] / full["update_seconds"]
        r["peak_rss_vs_full"] = r["peak_rss_mib"] / full["peak_rss_mib"]
    return {"rows": rows, "rounds": LORA_ROUNDS}


def decode_engines() -> dict:
    """Part 8: generated tokens/s of each in-process decoder on the same prompts (see the docstring)."""
    import torch

    import trainer.inference.generate as G
    from tests.bench_ref import pretrained_folder, problems
    from trainer.chat import encode_prompt
    from trainer.inference.cpu import FastDecoder
    from trainer.inference.cuda import StaticDecoder
    from trainer.model import load_model
    from trainer.tokenizer import load_tokenizer

    from trainer.engine import DETERMINISTIC, deterministic

    deterministic()  # as a run has it: on unless POSTTRAIN_DETERMINISTIC=0
    cuda = torch.cuda.is_available()
    folder = pretrained_folder(SHAPES["smollm2"])
    tok = load_tokenizer(folder)
    model = load_model(folder).to("cuda" if cuda else "cpu").eval()
    groups, samples, new = (16, 8, 128) if cuda else (4, 4, 32)
    prompts = [encode_prompt(tok, [{"role": "user", "content": p["question"]}])
               for p in problems(groups) for _ in range(samples)]
    decoders = {"HF generate": (model, None), "fixed shapes, eager": (model, StaticDecoder(model, graphs=False))}
    if cuda:
        decoders["fixed shapes, CUDA graphs"] = (model, StaticDecoder(model, graphs=True))
        half = load_model(folder, "bfloat16").to("cuda").eval()
        decoders["HF generate, bf16"] = (half, None)
        decoders["fixed shapes, CUDA graphs, bf16"] = (half, StaticDecoder(half, graphs=True))
    else:
        decoders["compiled (the CPU's)"] = (model, FastDecoder(model))
    rows = {}
    chosen = G.decoder_for
    try:
        for name, (m, dec) in decoders.items():
            G.decoder_for = lambda _m, _d=dec: _d
            times = []
            for rep in range(3):  # the first warms up (and captures the graphs)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                gens = G.generate(m, tok, prompts, new, temperature=1.0, seed=rep, min_new_tokens=new,
                                  batch_size=len(prompts))
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            n = sum(len(g.token_ids) for g in gens)
            r = rows[name] = {"seconds": statistics.median(times[1:]), "first_call_seconds": times[0], "tokens": n}
            r["tokens_per_second"] = n / r["seconds"]
            print(f"  {name:<28}{r['tokens_per_second']:>10,.0f} tok/s  ({n} tokens in {r['seconds']:.2f}s; "
                  f"first call {times[0]:.2f}s)", flush=True)
    finally:
        G.decoder_for = chosen
    return {"device": torch.cuda.get_device_name() if cuda else _cpu(), "rows": rows, "rows_decoded": len(prompts),
            "deterministic": os.environ.get(DETERMINISTIC, "1") != "0",
            "new_tokens": new, "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


# ---------------------------------------------------------------- one GPU (issue 43)

GPU_SHAPE = "smollm2-gpu"
# (label, tool, precision, extra bench_ref arguments, environment): TRL as it ships, posttrain as it ships
# (deterministic) and without determinism, fp32 and bf16, and TRL with transformers' continuous batching
GPU_SESSIONS = [
    ("TRL fp32", "trl", "fp32", [], {}),
    ("posttrain fp32", "posttrain", "fp32", [], {}),
    ("posttrain fp32, not deterministic", "posttrain", "fp32", [], {"POSTTRAIN_DETERMINISTIC": "0"}),
    ("TRL bf16", "trl", "bf16", [], {}),
    ("posttrain bf16", "posttrain", "bf16", [], {}),
    ("posttrain bf16, not deterministic", "posttrain", "bf16", [], {"POSTTRAIN_DETERMINISTIC": "0"}),
    ("TRL fp32, continuous batching", "trl", "fp32", ["--batching"], {}),
    # model.tf32 (off by default: it changes the numbers) against TRL's tf32=True
    ("TRL fp32, TF32", "trl", "fp32", ["--tf32"], {}),
    ("posttrain fp32, TF32", "posttrain", "fp32", ["--tf32"], {}),
]


def device_rates() -> dict:
    """The GPU's own ceilings, measured here: copy bandwidth (bytes read and written a second) and dense matmul
    rates in fp32 (TF32 as torch leaves it: off) and bf16."""
    import torch

    def best(f, reps: int = 5) -> float:
        f()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    x = torch.empty(2**28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    rates = {"copy_gb_per_s": 2 * x.numel() * 4 / best(lambda: y.copy_(x)) / 1e9}
    del x, y
    n = 8192
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
        rates[f"matmul_tflops_{name}"] = 2 * n**3 / best(lambda: a @ b) / 1e12
    return rates


def gpu_floor(shape: Shape, rates: dict, precision: str) -> dict:
    """Lower bounds on one step of the workload at this GPU's measured rates: generation reads every
    weight once a decoding step and does its matrix work (the larger of the two each step, plus the
    prefill), the update does forward and backward's matrix work; attention, sampling and the optimizer
    count as free."""
    flop = step_gflop(shape)
    h, L = shape.hidden, shape.layers
    params = L * sum(k * n for group in layer_linears(shape) for k, n in group) + h * shape.vocab
    width = 2 if precision == "bf16" else 4
    rate = rates[f"matmul_tflops_{precision}"] * 1e12
    per_step = max(params * width / (rates["copy_gb_per_s"] * 1e9), 2 * params * shape.batch / rate)
    prefill = 2 * params * shape.prompts * shape.prompt_tokens / rate
    generation = prefill + shape.new_tokens * per_step
    return {"generation_seconds": generation, "generation_tokens_per_second": shape.batch * shape.new_tokens / generation,
            "update_seconds": flop["training"] * 1e9 / rate, "step_seconds": generation + flop["training"] * 1e9 / rate}


def gpu_session(tool: str, precision: str, args: list[str], env: dict, shape: str = GPU_SHAPE) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.bench_ref", "--tool", tool, "--shape", shape,
                          "--precision", precision, *args], capture_output=True, text=True,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env}, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        return {"error": f"rc {out.returncode}: {out.stderr[-1500:]}"}
    return {k: v for k, v in json.loads(line[6:]).items() if k != "raw"}


def gpu_side_by_side(shape: str = GPU_SHAPE, sessions=None) -> dict:
    """posttrain against TRL on one GPU, each session its own process (see GPU_SESSIONS), with the
    floors at this GPU's measured rates beside them. A session that fails is reported, not fatal."""
    import torch

    rates = device_rates() if torch.cuda.is_available() else None
    rows = {}
    for label, tool, precision, args, env in sessions or GPU_SESSIONS:
        r = rows[label] = gpu_session(tool, precision, args, env, shape)
        if "error" in r:
            print(f"  {label:<36} failed: {r['error'][-300:]}", flush=True)
            continue
        r["precision"] = precision
        print(f"  {label:<36} step {r['step']:.3f}s  generation {r['gen_tokens_per_second']:,.0f} tok/s  "
              f"update {r['update']:.3f}s  sync {r.get('sync', 0.0):.4f}s  peak GPU "
              f"{(r.get('peak_gpu_mib') or 0):,.0f} MiB  ({r['decoder']})", flush=True)
    for label, r in rows.items():  # against TRL at the same precision (and TF32 or not), as it ships
        trl = rows.get(f"TRL {r.get('precision')}" + (", TF32" if label.endswith(", TF32") else ""))
        if "error" not in r and trl and "error" not in trl:
            r["vs_trl"] = {"step": r["step"] / trl["step"], "update": r["update"] / trl["update"],
                           "generation_tokens_per_second": r["gen_tokens_per_second"] / trl["gen_tokens_per_second"]}
    floors = {p: gpu_floor(SHAPES[shape], rates, p) for p in ("fp32", "bf16")} if rates else None
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu(), "shape": shape,
            "rates": rates, "floors": floors, "rows": rows}


def sandbox_throughput(n: int = 120) -> dict:
    """Policy-written code through trainer.problems.sandbox: executions a second on this machine's
    2 cores (1 and 2 at once), each a 10-line program against 5 hidden tests, beside the same
    program run by a bare `python -I -S` process (no namespaces, no limits): what isolation costs."""
    import subprocess
    import sys as _sys
    from concurrent.futures import ThreadPoolExecutor

    from trainer.problems import sandbox

    program = ("def f(xs):\n    out = []\n    for x in xs:\n        if x % 2:\n            out.append(3 * x + 1)\n"
               "        else:\n            out.append(x // 2)\n    return out\n")
    inputs = [[[i, i + 1, i + 2]] for i in range(5)]
    probe = sandbox.run(program, "f", inputs)
    assert probe.ended == "exit" and len(probe.values) == 5, probe

    def bare() -> None:
        code = program + "import json\nprint(json.dumps([f(*a) for a in %r]))\n" % (inputs,)
        subprocess.run([_sys.executable, "-I", "-S", "-c", code], check=True, capture_output=True)

    rows = {}
    for label, fn, workers in (("sandbox, 1 at a time", lambda: sandbox.run(program, "f", inputs), 1),
                               ("sandbox, 2 at a time", lambda: sandbox.run(program, "f", inputs), 2),
                               ("bare python -I -S, 2 at a time", bare, 2)):
        fn()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda _: fn(), range(n)))
        dt = time.perf_counter() - t0
        rows[label] = {"executions_per_second": n / dt, "ms_per_execution": 1000 * dt / n * workers}
        print(f"  {label}: {n / dt:.1f} executions/s", flush=True)
    return {"isolation": probe.isolation, "tests_per_execution": len(inputs), "executions": n, "rows": rows,
            "isolation_cost": rows["bare python -I -S, 2 at a time"]["executions_per_second"]
            / rows["sandbox, 2 at a time"]["executions_per_second"]}


def long_answers() -> dict:
    """GSM8K's answers are 100-300 tokens: posttrain and TRL on SmolLM2's real weights at 32 and at 256 new
    tokens (the same 16 sequences a step), and what a token costs at each: generation tokens/s, the
    update's seconds per token and the peak RSS per token (each over the sequences' prompt and new tokens).
    The update is also given per token it runs: posttrain runs a group's shared prompt once (4 prompts
    and 16 answers a step), TRL each sequence whole, so at 32 new tokens, where the prompts are most of
    a sequence, posttrain runs 56 % of the sequences' tokens and at 256 new tokens 89 %: per sequence
    token its update looks cheap at 32 and grows with the answers' length, per token run it does not."""
    out = grpo_side_by_side(["smollm2", "smollm2-256"], {"smollm2": 1, "smollm2-256": 1}, matmul_gflops())
    per_token = {}
    for shape, r in out.items():
        s = SHAPES[shape]
        tokens = s.batch * (s.prompt_tokens + s.new_tokens)
        run = {"trl": tokens, "posttrain": s.prompts * s.prompt_tokens + s.batch * s.new_tokens}
        per_token[shape] = {tool: {"gen_tokens_per_second": r[tool]["gen_tokens_per_second"],
                                   "update_ms_per_token": 1000 * r[tool]["update"] / tokens,
                                   "update_ms_per_token_run": 1000 * r[tool]["update"] / run[tool],
                                   "peak_rss_mib": r[tool]["peak_rss_mib"],
                                   "peak_rss_kib_per_token": 1024 * r[tool]["peak_rss_mib"] / tokens}
                            for tool in ("trl", "posttrain")}
    short, long_ = per_token["smollm2"], per_token["smollm2-256"]
    growth = {tool: {k: long_[tool][k] / short[tool][k] for k in short[tool]} for tool in ("trl", "posttrain")}
    return {"shapes": out, "per_token": per_token, "long_over_short": growth}


# the parts `--only` runs alone: (the line printed before it, the part)
ONLY = {"async": ("async rounds (posttrain grpo, tiny preset):", lambda: async_rounds()),
        "ppo": ("PPO against GRPO (tiny preset rounds, each mode its own process):", lambda: ppo_against_grpo()),
        "lora": ("LoRA against full fine-tuning (smollm2-135m GRPO rounds, each its own process):",
                 lambda: lora_against_full()),
        "decode": ("the in-process decoders on SmolLM2-135M (GPU when there is one):", lambda: decode_engines()),
        "sandbox": ("policy-written code in the sandbox (trainer.problems.sandbox):", lambda: sandbox_throughput()),
        "long": ("GSM8K-length answers: SmolLM2-135M at 32 and 256 new tokens, posttrain against TRL:",
                 lambda: long_answers()),
        "gpu": ("GRPO on one GPU, posttrain against TRL (SmolLM2-135M, 16 prompts x 8 samples x 128 tokens):",
                lambda: gpu_side_by_side())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the reference shapes only, no pipeline run")
    ap.add_argument("--only", choices=sorted(ONLY), help="one part alone")
    ap.add_argument("--gpu-sessions", help="on a GPU, these of GPU_SESSIONS' labels only (separated by ';')")
    ap.add_argument("--ppo-session", choices=["group", "gae"], help=argparse.SUPPRESS)
    ap.add_argument("--lora-session", choices=LORA_MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ppo_session:
        ppo_session(a.ppo_session)
        return
    if a.lora_session:
        lora_session(a.lora_session)
        return
    import torch

    from trainer import kernels

    parts = dict(ONLY)
    if a.gpu_sessions:
        wanted = [x.strip() for x in a.gpu_sessions.split(";")]
        unknown = set(wanted) - {row[0] for row in GPU_SESSIONS}
        if unknown:
            ap.error(f"--gpu-sessions: no session named {sorted(unknown)}; the sessions: {[r[0] for r in GPU_SESSIONS]}")
        chosen = [row for row in GPU_SESSIONS if row[0] in wanted]
        parts["gpu"] = (ONLY["gpu"][0], lambda: gpu_side_by_side(sessions=chosen))
    # which compiled variant the posttrain sessions run (POSTTRAIN_KERNELS_ISA picks a narrower one)
    out: dict = {"machine": {"cpu": _cpu(), "threads": 2, "kernels": kernels.variant(),
                             "torch_isa": torch.backends.cpu.get_cpu_capability()}}
    gflops = matmul_gflops()
    out["machine"]["matmul_gflops"] = gflops
    print(f"fp32 matmul (2048^3, 2 threads): {gflops:.1f} GFLOP/s", flush=True)
    if a.only:  # one part alone, into its own file
        title, run = parts[a.only]
        print(title, flush=True)
        out[a.only] = run()
        path = f"bench-results/bench-{a.only}.json"
        Path("bench-results").mkdir(exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2))
        report(out, path)
        return
    if torch.cuda.is_available():  # on a GPU: the GPU's own table and the decoders (issue 43)
        for part in ("gpu", "decode"):
            title, run = parts[part]
            print(title, flush=True)
            out[part] = run()
        Path("bench-results").mkdir(exist_ok=True)
        Path("bench-results/bench.json").write_text(json.dumps(out, indent=2))
        report(out)
        return
    shapes = ["ref", "ref-kl"] + ([] if a.quick else ["large", "smollm2"])
    print("GRPO sessions (TRL and posttrain alternating):", flush=True)
    out["grpo"] = grpo_side_by_side(shapes, {"ref": 3, "ref-kl": 1, "large": 1, "smollm2": 2}, gflops)
    print("SFT against a plain PyTorch loop:", flush=True)
    out["sft"] = sft_against_plain_loop()
    if not a.quick:
        print("a real pipeline run (Prefect + MLflow), then the same command fully cached:", flush=True)
        out["pipeline"] = pipeline_overhead()
        print("async rounds (posttrain grpo, tiny preset):", flush=True)
        out["async"] = async_rounds()
    print("PPO against GRPO (tiny preset rounds, each mode its own process):", flush=True)
    out["ppo"] = ppo_against_grpo()
    if not a.quick:
        print(ONLY["lora"][0], flush=True)
        out["lora"] = lora_against_full()
    print(ONLY["sandbox"][0], flush=True)
    out["sandbox"] = sandbox_throughput()
    if not a.quick:
        print(ONLY["long"][0], flush=True)
        out["long"] = long_answers()
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/bench.json").write_text(json.dumps(out, indent=2))
    report(out)


def _cpu() -> str:
    try:
        return next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def report(out: dict, path: str = "bench-results/bench.json") -> None:
    print()
    m = out["machine"]
    print(f"machine: {m['cpu']}, 2 threads, fp32 matmul {m['matmul_gflops']:.1f} GFLOP/s; posttrain kernels "
          f"{m.get('kernels', '?')}, torch ops {m.get('torch_isa', '?')}")
    if "grpo" in out:
        print(f"{'GRPO step (median)':<22}{'':>2}{'TRL':>10}{'posttrain':>11}{'ratio':>8}")
    for shape, r in out.get("grpo", {}).items():
        t, p, q = r["trl"], r["posttrain"], r["ratios"]
        s = SHAPES[shape]
        what = "SmolLM2-135M-Instruct, real weights, " if s.pretrained else ""
        print(f"[{shape}] {what}h{s.hidden} x{s.layers}, {s.batch} x {s.new_tokens} tokens, KL {s.kl}: "
              f"{r['gflop_per_step']['total']:.1f} GFLOP/step, {r['floor_seconds']:.3f}s at the 2048^3 matmul rate; "
              f"posttrain decodes with its {p['decoder']}")
        rows = [("step s", t["step"], p["step"], q["step"]),
                ("generation s", t["generate"], p["generate"], p["generate"] / t["generate"]),
                ("generation tok/s", t["gen_tokens_per_second"], p["gen_tokens_per_second"],
                 q["generation_tokens_per_second"]),
                ("update s", t["update"], p["update"], q["update"]),
                ("peak RSS MiB", t["peak_rss_mib"], p["peak_rss_mib"], q["peak_rss"]),
                ("2048^3-rate s / step", t["floor_fraction"], p["floor_fraction"], p["floor_fraction"] / t["floor_fraction"])]
        for name, a, b, c in rows:
            print(f"  {name:<20}{a:>12,.3f}{b:>11,.3f}{c:>8.2f}")
        lin, goal = r["linear_floor_seconds"], r["targets_seconds"]
        print(f"  linear layers' matmuls alone (a lower bound): generation {lin['generation']:.3f}s, update "
              f"{lin['update']:.3f}s, step {lin['step']:.3f}s; targets: generation <= {goal['generation']:.3f}s "
              f"({goal['generation_speedup']:g}x TRL's tok/s), step <= {goal['step']:.3f}s ({goal['step_ratio']:g} of TRL's)")
    s = out.get("sft")
    if s:
        print(f"SFT tokens/s ({s['steps']} steps; tokens are the examples' own, padding not counted):\n"
              f"  plain PyTorch loop (padded)   {s['plain_loop_tokens_per_second']:>8,.0f}\n"
              f"  posttrain, padded like it     {s['posttrain_padded_tokens_per_second']:>8,.0f}  ratio {s['padded_ratio']:.2f}\n"
              f"  posttrain as it trains        {s['posttrain_tokens_per_second']:>8,.0f}  ratio {s['ratio']:.2f} (packed)")
    if "pipeline" in out:
        p = out["pipeline"]
        print(f"pipeline: a GRPO round {p['round_seconds_in_trainer']:.3f}s in the trainer + "
              f"{p['round_seconds_outside_trainer']:.3f}s outside it (Prefect tasks, MLflow) = "
              f"{100 * p['outside_fraction']:.1f}% of the round; a fully cached re-run of the command "
              f"{p['cached_rerun_seconds']:.1f}s (first run {p['first_run_seconds']:.1f}s)")
    if "async" in out:
        print("async rounds, tiny preset, rounds 2-20 (pinned: trainer on core 0, rollout process or server on core 1;")
        print("  pinned rows: the mean of two passes, 0 1 2 then 2 1 0, and each pass's ratio to its own sync row)")
        print(f"  {'engine':<8}{'async_steps':>12}{'cores':>10}{'rounds/min':>12}{'tok/s':>10}{'vs sync':>9}"
              f"{'passes':>13}{'wait s':>8}{'update s':>10}")
        for r in out["async"]["rows"]:
            passes = " / ".join(f"{v:.2f}" for v in r["vs_sync_passes"]) if r["pinned"] and r["async_steps"] else ""
            print(f"  {r['engine']:<8}{r['async_steps']:>12}{'pinned' if r['pinned'] else 'unpinned':>10}"
                  f"{r['rounds_per_minute']:>12.1f}{r['tokens_per_second']:>10,.0f}{r['vs_pinned_sync']:>9.2f}"
                  f"{passes:>13}{r['queue_wait_seconds']:>8.3f}{r['update_seconds']:>10.3f}")
    if "ppo" in out:
        p = out["ppo"]
        print(f"PPO (gae) against GRPO (group), tiny preset, {p['samples_per_round']} samples a round, medians:")
        print(f"  {'':<8}{'update s':>10}{'generation s':>14}{'peak RSS MiB':>14}")
        for m in ("group", "gae"):
            print(f"  {m:<8}{p[m]['update_seconds']:>10.3f}{p[m]['generate_seconds']:>14.3f}{p[m]['peak_rss_mib']:>14,.0f}")
        print(f"  gae / group: update {p['ratios']['update']:.2f}, peak RSS {p['ratios']['peak_rss']:.2f}")
    if "lora" in out:
        rows = out["lora"]["rows"]
        print(f"LoRA against full fine-tuning, smollm2-135m GRPO, {rows['full']['samples']:.0f} samples a round, "
              f"medians of rounds 2-{out['lora']['rounds']}:")
        print(f"  {'':<10}{'trainable':>13}{'update s':>10}{'vs full':>9}{'generation s':>14}{'peak RSS MiB':>14}{'vs full':>9}")
        for mode, r in rows.items():
            name = mode if mode.startswith("full") else f"rank {mode}"
            print(f"  {name:<10}{r['trainable_params']:>13,}{r['update_seconds']:>10.3f}{r['update_vs_full']:>9.2f}"
                  f"{r['generate_seconds']:>14.3f}{r['peak_rss_mib']:>14,.0f}{r['peak_rss_vs_full']:>9.2f}")
    if "gpu" in out:
        g = out["gpu"]
        s = SHAPES[g["shape"]]
        print(f"GRPO on {g['device']}, {g['shape']}: {s.prompts} prompts x {s.samples} samples x {s.new_tokens} "
              f"tokens, {s.steps} steps measured after {s.warmup} (medians; ratios against TRL at the same precision)")
        print(f"  {'':<36}{'step s':>8}{'x TRL':>7}{'gen tok/s':>11}{'x TRL':>7}{'update s':>10}{'x TRL':>7}"
              f"{'sync s':>8}{'peak GPU MiB':>14}")
        for label, r in g["rows"].items():
            if "error" in r:
                print(f"  {label:<36} failed (see bench.json)")
                continue
            v = r.get("vs_trl", {})
            print(f"  {label:<36}{r['step']:>8.3f}{v.get('step', 1.0):>7.2f}{r['gen_tokens_per_second']:>11,.0f}"
                  f"{v.get('generation_tokens_per_second', 1.0):>7.2f}{r['update']:>10.3f}{v.get('update', 1.0):>7.2f}"
                  f"{r.get('sync', 0.0):>8.4f}{(r.get('peak_gpu_mib') or 0):>14,.0f}")
        if g["floors"]:
            ra = g["rates"]
            print(f"  floor at this GPU's measured rates (copy {ra['copy_gb_per_s']:,.0f} GB/s, matmul fp32 "
                  f"{ra['matmul_tflops_fp32']:.0f} / bf16 {ra['matmul_tflops_bf16']:.0f} TFLOP/s):")
            for p, f in g["floors"].items():
                print(f"  {'floor ' + p:<36}{f['step_seconds']:>8.3f}{'':>7}{f['generation_tokens_per_second']:>11,.0f}"
                      f"{'':>7}{f['update_seconds']:>10.3f}")
    if "decode" in out:
        d = out["decode"]
        print(f"in-process decoders on {d['device']}, SmolLM2-135M, {d['rows_decoded']} rows x {d['new_tokens']} tokens:")
        base = d["rows"]["HF generate"]["tokens_per_second"]
        for name, r in d["rows"].items():
            print(f"  {name:<28}{r['tokens_per_second']:>10,.0f} tok/s{r['tokens_per_second'] / base:>8.2f}x")
    if "long" in out:
        lo = out["long"]
        print("GSM8K-length answers, SmolLM2-135M-Instruct's real weights, 16 sequences a step (medians):")
        print(f"  {'':<22}{'gen tok/s':>11}{'update ms/token':>17}{'ms/token run':>14}{'peak RSS MiB':>14}"
              f"{'RSS KiB/token':>15}")
        for shape, tools in lo["per_token"].items():
            for tool, r in tools.items():
                print(f"  {SHAPES[shape].new_tokens:>3} tokens, {tool:<10}{r['gen_tokens_per_second']:>11,.0f}"
                      f"{r['update_ms_per_token']:>17.2f}{r['update_ms_per_token_run']:>14.2f}{r['peak_rss_mib']:>14,.0f}"
                      f"{r['peak_rss_kib_per_token']:>15.1f}")
        for tool, g in lo["long_over_short"].items():
            print(f"  256 over 32 tokens, {tool}: generation tok/s x{g['gen_tokens_per_second']:.2f}, update per token "
                  f"x{g['update_ms_per_token']:.2f} (per token run x{g['update_ms_per_token_run']:.2f}), "
                  f"peak RSS x{g['peak_rss_mib']:.2f}")
        for shape in lo["shapes"]:
            q = lo["shapes"][shape]["ratios"]
            print(f"  posttrain / TRL at {SHAPES[shape].new_tokens} tokens: step {q['step']:.2f}, generation tok/s "
                  f"{q['generation_tokens_per_second']:.2f}, update {q['update']:.2f}, peak RSS {q['peak_rss']:.2f}")
    if "sandbox" in out:
        b = out["sandbox"]
        print(f"sandbox ({b['isolation']} isolation), a program against {b['tests_per_execution']} hidden tests, "
              f"{b['executions']} executions:")
        for label, r in b["rows"].items():
            print(f"  {label:<32}{r['executions_per_second']:>8.1f} executions/s{r['ms_per_execution']:>8.1f} ms each")
        print(f"  isolation costs {b['isolation_cost']:.2f}x a bare interpreter's executions/s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
