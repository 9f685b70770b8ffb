"""Where a GPU's time goes in posttrain's two hot loops (issue 43), for a lease's measurement script
(`tests/gpu_session.sh`); CUDA only. Run from the project root: `python -m tests.gpu_profile`.

1. The fixed-shape decoder on `bench_ref`'s smollm2-gpu workload (SmolLM2-135M, 16 prompts x 8
   samples x 128 new tokens, T = 1), fp32 and bf16, with sampling and the step's bookkeeping
   captured as a graph of their own and eagerly: tokens/s of a whole call, the captured step's replay
   alone and the captured sampling's (so the host's per-step work is the rest), and the kernels of one
   replayed step from torch.profiler.
2. The GRPO update on the same workload, bf16 and fp32 at ZeRO stage 0, and bf16 again in a
   process of its own with POSTTRAIN_DETERMINISTIC=0 (what the deterministic default costs, phase
   by phase and operator by operator): each phase of a round (the micro-batch's forward and loss,
   backward, the optimizer step) timed with the device synchronised around it, and the operators
   that take the device's time.
3. `ops`, asked for by name (also on a CPU: `python -m tests.gpu_profile ops`): the ATen operators
   one GRPO update issues, bf16 and fp32, by phase, posttrain's and TRL's, on `smollm2-ops`
   (SmolLM2's 30 layers and head counts at a 32nd of its width: the count depends on the layers,
   not their width or the device). On a GPU the update is bound by the host issuing operators
   (docs/gpu.md), so this count predicts its time where there is no GPU to measure it. On a CPU
   posttrain runs as it would on a GPU (one pass per sequence through the model's own layers, the
   accelerator's head blocks).

Prints a table at the end; the JSON goes to $OUT/profile.json (or gpu-out/)."""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _sync_time(f):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    r = f()
    sync()
    return time.perf_counter() - t0, r


def _top_kernels(prof, n: int = 12) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.key and not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset", "ProfilerStep")):
            rows.append({"kernel": e.key[:90], "calls": e.count, "us": t})
    rows.sort(key=lambda r: -r["us"])
    return rows[:n]


def _top_ops(prof, n: int = 15) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t and e.key.startswith("aten::"):
            rows.append({"op": e.key, "calls": e.count, "self_device_us": t, "cpu_us": e.cpu_time_total})
    rows.sort(key=lambda r: -r["self_device_us"])
    return rows[:n]


def decode_profile() -> dict:
    import trainer.inference.generate as G
    from tests.bench_ref import SHAPES, pretrained_folder, problems
    from trainer.chat import encode_prompt
    from trainer.engine import deterministic
    from trainer.inference.cpu import sample
    from trainer.inference.cuda import StaticDecoder, race
    from trainer.model import load_model
    from trainer.tokenizer import load_tokenizer

    deterministic()
    out = {"samplers": {}}

    scores = torch.randn(128, 49152, device="cuda")  # a smollm2-gpu step's rows over SmolLM2's vocabulary
    for name, draw in (("inverse CDF (the CPU decoder's)", sample), ("Gumbel-max race (the fixed decoder's)", race)):
        draw(scores)
        t, _ = _sync_time(lambda: [draw(scores) for _ in range(100)])
        out["samplers"][name] = 1e3 * t / 100
        print(f"sampler {name:<40} {out['samplers'][name]:.3f} ms a step", flush=True)
    shape = SHAPES["smollm2-gpu"]
    folder = pretrained_folder(shape)
    tok = load_tokenizer(folder)
    prompts = [encode_prompt(tok, [{"role": "user", "content": p["question"]}])
               for p in problems(shape.prompts) for _ in range(shape.samples)]
    new = shape.new_tokens
    for dtype in ("float32", "bfloat16"):
        model = load_model(folder, dtype).to("cuda").eval()
        for captured in (False, True):  # sampling and the step's bookkeeping eagerly, or captured too
            dec = StaticDecoder(model, graphs=True)
            dec.graph_advance = captured
            chosen = G.decoder_for
            G.decoder_for = lambda _m, _d=dec: _d
            try:
                times = []
                for rep in range(4):
                    t, gens = _sync_time(lambda: G.generate(model, tok, prompts, new, temperature=1.0, seed=rep,
                                                            min_new_tokens=new, batch_size=len(prompts)))
                    times.append(t)
            finally:
                G.decoder_for = chosen
            n = sum(len(g.token_ids) for g in gens)
            (st,) = dec.shapes.values()
            row = {"tokens_per_second": n / statistics.median(times[1:]), "call_seconds": statistics.median(times[1:]),
                   "first_call_seconds": times[0], "graphs": st.graph is not None}
            if st.graph is not None:
                reps = 200
                t, _ = _sync_time(lambda: [st.graph.replay() for _ in range(reps)])
                row["replay_ms"] = 1e3 * t / reps
                row["step_ms"] = 1e3 * row["call_seconds"] / new
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(8):
                        st.graph.replay()
                    torch.cuda.synchronize()
                kernels = _top_kernels(prof, 14)
                row["kernels_per_step"] = sum(e.count for e in prof.key_averages()
                                              if (getattr(e, "device_time_total", 0) or 0) > 0
                                              and not e.key.startswith(("aten::", "cuda"))) / 8
                row["top_kernels"] = kernels
                advances = [g for g in st.advances.values() if g is not None]
                if advances:  # last: each replay moves the state's column on, past the cache's width
                    t, _ = _sync_time(lambda: [advances[0].replay() for _ in range(reps)])
                    row["advance_replay_ms"] = 1e3 * t / reps
            label = f"{'fp32' if dtype == 'float32' else 'bf16'} {'captured' if captured else 'eager'} sampling"
            out[label] = row
            print(f"decode {label:<22} {row['tokens_per_second']:>9,.0f} tok/s  call {row['call_seconds']:.3f}s  "
                  f"step {row.get('step_ms', 0):.2f} ms  replay {row.get('replay_ms', 0):.2f} ms  "
                  f"advance {row.get('advance_replay_ms', 0):.2f} ms  "
                  f"kernels/step {row.get('kernels_per_step', 0):.0f}", flush=True)
            del dec
        del model
        torch.cuda.empty_cache()
    return out


def decode_variants(device: str = "cuda", rounds: int = 2, calls: int = 3, small: bool = False) -> dict:
    """`variants`: the fixed-shape decoder as shipped against itself with one change at a time
    undone, on SmolLM2-135M's shape with random weights (16 prompts of 40 tokens x 8 samples x 128
    new tokens, T = 1, no EOS before the end: a decode's time does not depend on the weights'
    values, so no model file is needed), fp32 and bf16, alternating the variants `rounds` times in
    one process: tokens/s of a `decode` call (`calls` timed after one that captures). The changes:
    attending only the filled columns rounded up (`width_graphs`), bf16's norm in two kernels
    (`_fast_rms`; four before), the prefill captured (`graph_prefill`; before, it ran eagerly
    through separate products), and the host's look every CHECK_EVERY steps (`no look`: never).
    Then where a call's time goes: its fixed part (a call of one new token) and the prefill alone,
    with the device synchronised around each. `small`: 2 layers, 4 x 2 rows, 16 new tokens (the CPU
    suite runs it so, eagerly: tests/test_fixed_decoder.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.engine import deterministic
    from trainer.inference import cuda as C

    deterministic()
    fast_rms = C._fast_rms

    def four_kernel_rms(x, weight, eps):  # bf16's norm before: cast, fused kernel, cast back, weight
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return fast_rms(x, weight, eps)
        return weight * torch.nn.functional.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    class UnfusedPrefill(C.StaticDecoder):  # the prefill through separate products (the steps' stay fused)
        def _prefill(self, pf):
            self.fuse = False
            try:
                super()._prefill(pf)
            finally:
                self.fuse = True

    def make(name: str, model) -> C.StaticDecoder:
        dec = (UnfusedPrefill if name == "before" else C.StaticDecoder)(model, graphs=device == "cuda")
        if name in ("before", "whole width"):
            dec.width_graphs = False
        if name in ("before", "prefill eager"):
            dec.graph_prefill = False
        return dec

    variants = ["as shipped", "before", "whole width", "four-kernel norm", "prefill eager", "no look"]
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
    groups, samples, new = (4, 2, 16) if small else (16, 8, 128)
    if small:
        cfg.num_hidden_layers, cfg.vocab_size = 2, 512
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (40,), generator=g).tolist() for _ in range(groups)]
    prompts = [p for p in prompts for _ in range(samples)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(device, dtype).eval()
        decs = {name: make(name, model) for name in variants}
        times: dict[str, list[float]] = {name: [] for name in variants}

        def call(name, max_new=new):
            C._fast_rms = four_kernel_rms if name in ("before", "four-kernel norm") else fast_rms
            check = C.CHECK_EVERY
            C.CHECK_EVERY = 10 ** 9 if name == "no look" else check
            try:
                return _sync_time(lambda: decs[name].decode(prompts, max_new, 0, 1, temperature=1.0, min_new=max_new))
            finally:
                C._fast_rms, C.CHECK_EVERY = fast_rms, check

        for name in variants:
            call(name)  # captures
        for r in range(rounds):
            for name in (variants if r % 2 == 0 else variants[::-1]):
                times[name] += [call(name)[0] for _ in range(calls)]
        label = "fp32" if dtype == torch.float32 else "bf16"
        rows = {name: {"tokens_per_second": len(prompts) * new / statistics.median(ts),
                       "call_seconds": statistics.median(ts), "calls": ts} for name, ts in times.items()}
        for name in ("as shipped", "before"):  # a call's fixed part, and the prefill within it
            fixed = statistics.median([call(name, 1)[0] for _ in range(3)])
            dec, spent = decs[name], []
            forward = dec._run_prefill

            def timed_forward(*a, _f=forward, **k):
                torch.cuda.synchronize() if device == "cuda" else None
                t0 = time.perf_counter()
                r = _f(*a, **k)
                torch.cuda.synchronize() if device == "cuda" else None
                spent.append(time.perf_counter() - t0)
                return r

            dec._run_prefill = timed_forward
            call(name)
            del dec._run_prefill
            rows[name].update(fixed_seconds=fixed, prefill_seconds=spent[0],
                              step_ms=1e3 * (rows[name]["call_seconds"] - fixed) / (new - 1))
        st = next(iter(decs["as shipped"].shapes.values()))
        if device == "cuda":
            for width, graph in sorted(st.graphs.items()):
                t, _ = _sync_time(lambda: [graph.replay() for _ in range(100)])
                rows["as shipped"][f"replay_ms_width_{width}"] = 10 * t
        out[label] = rows
        for name, row in rows.items():
            extra = "".join(f"  {k} {v:.4f}" for k, v in row.items() if k.endswith(("seconds", "_ms")) or "width" in k)
            print(f"variants {label} {name:<17} {row['tokens_per_second']:>9,.0f} tok/s{extra}", flush=True)
        del decs, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def update_profile(precision: str, stage: int, shape_name: str = "smollm2-gpu") -> dict:
    from tests.bench_ref import SHAPES, model, posttrain_config, problems, tokenizer
    from trainer import engine as ds
    from trainer.grpo import GRPOTrainer

    shape = SHAPES[shape_name]
    work = Path(tempfile.mkdtemp())
    tok = tokenizer(work / "tok", shape)
    policy = model(shape, tok)
    rows = problems(shape.prompts * 4)
    train = [{"id": r["id"], "answer": r["answer"],
              "messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": ""}]}
             for r in rows]
    cfg = posttrain_config(shape, precision, (f"grpo.deepspeed.zero_stage={stage}", "grpo.rounds=4"))
    trainer = GRPOTrainer(cfg, policy, tok, train, train[:8], work / "grpo")
    phases = {"forward+loss": 0.0, "backward": 0.0, "optimizer step": 0.0}
    timing = {"on": False}

    def timed(name, f):
        def run(*a, **k):
            if not timing["on"]:
                return f(*a, **k)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = f(*a, **k)
            torch.cuda.synchronize()
            phases[name] += time.perf_counter() - t0
            return r
        return run

    trainer._micro_loss = timed("forward+loss", trainer._micro_loss)
    trainer.ds.backward = timed("backward", trainer.ds.backward)
    trainer.ds.step = timed("optimizer step", trainer.ds.step)
    updates, prof_rows = [], None
    torch.manual_seed(42)
    r = 0
    while not trainer.done():
        batch = trainer.score(trainer.rollout())
        r += 1
        timing["on"] = r >= 2
        if r == 4:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                stats = trainer.update(batch)
                torch.cuda.synchronize()
            prof_rows = _top_ops(prof)
        else:
            stats = trainer.update(batch)
        trainer.publish(stats)
        if r >= 2:
            updates.append(stats["time/update_seconds"])
    n = len(updates)
    out = {"update_seconds": statistics.median(updates),
           "phases_seconds": {k: v / n for k, v in phases.items()},
           "optimizer": type(trainer.ds.optimizer).__name__, "top_ops": prof_rows,
           "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20}
    print(f"update {precision} ZeRO-{stage}: {out['update_seconds']:.3f}s  " + "  ".join(
        f"{k} {v:.3f}s" for k, v in out["phases_seconds"].items()) + f"  ({out['optimizer']})", flush=True)
    return out


def update_profile_nondeterministic(precision: str) -> dict:
    """`update_profile` at ZeRO stage 0 without torch's deterministic mode: run by `_in_own_process`,
    since a process that has turned the mode on keeps it (`trainer.engine.deterministic`)."""
    os.environ["POSTTRAIN_DETERMINISTIC"] = "0"
    out = update_profile(precision, 0)
    print(f"{precision} not deterministic: update {out['update_seconds']:.3f}s  " + "  ".join(
        f"{k} {v:.3f}s" for k, v in out["phases_seconds"].items()), flush=True)
    return out


class _Ops:
    """Counts the ATen operators dispatched inside `with` (autograd's backward included), and the
    device synchronisations among them (a tensor's value read by the host)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()
        self.on = True
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if outer.on:
                    counts[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def row(self) -> dict:
        return {"operators": sum(self.counts.values()),
                "host_reads": self.counts["aten._local_scalar_dense"] + self.counts["aten.nonzero"],
                "top": self.counts.most_common(8)}


def update_operators(precision: str = "bf16") -> dict:
    """`ops`: the operators of one GRPO update (the last measured round's), posttrain's by phase and
    TRL's (its training step less generation, and its optimizer step)."""
    import trl

    import trainer.grpo as G
    from tests import bench_ref
    from trainer.rl import logprobs

    shape = bench_ref.SHAPES["smollm2-ops"]
    out: dict[str, dict] = {}
    phases: dict[str, _Ops] = {}

    def counted(name, f):
        def run(*a, **k):
            with phases.setdefault(name, _Ops()):
                return f(*a, **k)
        return run

    train_step, generate, adamw = (trl.GRPOTrainer.training_step, trl.GRPOTrainer._generate_single_turn,
                                   torch.optim.AdamW.step)

    def step_less_generation(self, *a, **k):  # the last step's count is kept, and its optimizer step's
        phases.clear()
        with phases.setdefault("update", _Ops()):
            return train_step(self, *a, **k)

    def paused(self, *a, **k):  # generation is not the update's
        ops = phases.get("update")
        if ops is not None:
            ops.on = False
        try:
            return generate(self, *a, **k)
        finally:
            if ops is not None:
                ops.on = True

    trl.GRPOTrainer.training_step, trl.GRPOTrainer._generate_single_turn = step_less_generation, paused
    torch.optim.AdamW.step = lambda self, *a, **k: counted("optimizer step", adamw)(self, *a, **k)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench_ref.run_trl(shape, Path(tmp), precision)
    finally:
        trl.GRPOTrainer.training_step, trl.GRPOTrainer._generate_single_turn = train_step, generate
        torch.optim.AdamW.step = adamw
    out["TRL"] = {k: v.row() for k, v in phases.items()}
    phases.clear()
    # TRL first: posttrain's run turns on torch's deterministic algorithms for the process, which
    # changes the operators TRL's update issues (bench_ref's sessions each run in their own process)
    update, response_logprobs, step = G.GRPOTrainer.update, G.response_logprobs, G.ds.step
    layout = (logprobs.SHARED_PREFIX_DEVICES, logprobs.LOGSUMEXP_DEVICES, logprobs.HEAD_BLOCK_ELEMENTS,
              logprobs.fasttrain.unsupported)
    if not torch.cuda.is_available():  # posttrain's update as it runs off the CPU (no compiled CPU passes)
        logprobs.SHARED_PREFIX_DEVICES = logprobs.LOGSUMEXP_DEVICES = ()
        logprobs.HEAD_BLOCK_ELEMENTS = logprobs.ACCELERATOR_HEAD_BLOCK_ELEMENTS
        logprobs.fasttrain.unsupported = lambda _m: "a GPU (emulated)"

    def one_update(self, batch):
        phases.clear()
        backward = self.ds.backward
        self.ds.backward = counted("backward", backward)
        try:
            with phases.setdefault("update", _Ops()):
                return update(self, batch)
        finally:
            self.ds.backward = backward

    G.GRPOTrainer.update, G.response_logprobs = one_update, counted("forward", response_logprobs)
    G.ds.step = counted("optimizer step", step)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench_ref.run_posttrain(shape, Path(tmp), precision)
    finally:
        G.GRPOTrainer.update, G.response_logprobs, G.ds.step = update, response_logprobs, step
        (logprobs.SHARED_PREFIX_DEVICES, logprobs.LOGSUMEXP_DEVICES, logprobs.HEAD_BLOCK_ELEMENTS,
         logprobs.fasttrain.unsupported) = layout
    out["posttrain"] = {k: v.row() for k, v in phases.items()}
    for tool, rows in out.items():
        print(f"{precision} {tool:<10} " + "  ".join(f"{k} {v['operators']:,} ops ({v['host_reads']} host reads)"
                                         for k, v in rows.items()), flush=True)
    return out


def _in_own_process(function: str, *args: str) -> dict:
    """`function(*args)` of this module in a fresh interpreter: torch's deterministic switch, which a
    posttrain run turns on, stays on for its process and changes the operators of what runs after."""
    import subprocess

    code = (f"import json, sys; from tests import gpu_profile as P; r = P.{function}(*{list(args)!r}); "
            "sys.stdout.write('RESULT ' + json.dumps(r) + '\\n')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("RESULT ")]
    print("\n".join(line for line in lines if line.startswith(tuple(args))), flush=True)
    found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        return {"error": (proc.stderr or proc.stdout)[-800:]}
    return json.loads(found[-1])


def main() -> None:
    which = sys.argv[1:] or ["decode", "update"]
    if not torch.cuda.is_available() and not set(which) <= {"ops", "variants"}:
        sys.exit("tests.gpu_profile measures a CUDA device; this machine has none (`ops` and `variants` run anywhere)")
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__}
    path = Path(os.environ.get("OUT", "gpu-out")) / "profile.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if "decode" in which:
        res["decode"] = decode_profile()
        path.write_text(json.dumps(res, indent=1))
    if "update" in which:
        res["update"] = {}
        for precision, stage in (("bf16", 0), ("fp32", 0)):  # as the smollm2 presets and bench_ref's shape run
            try:
                res["update"][f"{precision} ZeRO-{stage}"] = update_profile(precision, stage)
            except Exception as e:  # one failing setting leaves the others their turn
                res["update"][f"{precision} ZeRO-{stage}"] = {"error": repr(e)[-800:]}
                print(f"update {precision} ZeRO-{stage} failed: {e!r}"[-800:], flush=True)
            path.write_text(json.dumps(res, indent=1))
            torch.cuda.empty_cache()
        res["update"]["bf16 ZeRO-0, not deterministic"] = _in_own_process("update_profile_nondeterministic", "bf16")
        path.write_text(json.dumps(res, indent=1))
    if "variants" in which:
        res["variants"] = decode_variants("cuda" if torch.cuda.is_available() else "cpu", rounds=2, calls=2)
        path.write_text(json.dumps(res, indent=1))
    if "ops" in which:
        res["ops"] = {precision: _in_own_process("update_operators", precision) for precision in ("bf16", "fp32")}
        path.write_text(json.dumps(res, indent=1))
    for label, row in res.get("decode", {}).items():
        if label == "samplers":
            continue
        print(f"\n{label}: top kernels of one replayed step (us over 8 steps)")
        for k in row.get("top_kernels", [])[:10]:
            print(f"  {k['us']:>9.0f}  {k['calls']:>5}  {k['kernel']}")
    for label, row in res.get("update", {}).items():
        print(f"\nupdate {label}: top ops by device time (us)")
        for k in (row.get("top_ops") or [])[:10]:
            print(f"  {k['self_device_us']:>9.0f}  {k['calls']:>5}  {k['op']}  (cpu {k['cpu_us']:.0f})")


if __name__ == "__main__":
    main()
