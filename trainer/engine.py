"""DeepSpeed set-up shared by SFT and GRPO: process group, engine config, model export."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer.config import DeepSpeedConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_OWNER = "POSTTRAIN_ONE_RANK_GROUP_PID"  # set when this module made up a one-rank group's settings

DETERMINISTIC = "POSTTRAIN_DETERMINISTIC"  # "0": faster nondeterministic kernels, no exact resume
_determinism_set = False


def deterministic() -> None:
    """Ask torch for deterministic kernels, on the CPU as on a GPU, so that a run's weights do not
    depend on thread timing: a resumed run always runs under other load than the run it resumes.

    Without it, torch's CPU `index_put_(accumulate=True)` (the backward of advanced indexing, such
    as HF's KV-cache `batch_select_indices`) adds from several threads with atomics, in whatever
    order the threads reach each element; on a GPU, embedding backward and cuBLAS's workspace
    reductions do likewise. Strict, not warn-only: with warn_only, SDPA's memory-efficient CUDA
    backward keeps its nondeterministic kernel. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it first
    starts, so this runs before any GPU work. The NaN fill of fresh allocations (a debugging aid of
    the same switch, on by default) is left off, on the CPU as on a GPU: no kernel here reads memory
    it did not write, and the fill is one more kernel and one more pass over every new buffer (on a
    GPU, a launch for each of the hundreds of tensors a decoding step allocates).
    `POSTTRAIN_DETERMINISTIC=0` turns all of it off (docs/reproducibility.md)."""
    global _determinism_set
    if _determinism_set or os.environ.get(DETERMINISTIC, "1") == "0":
        return
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.use_deterministic_algorithms(True)
    _determinism_set = True


def fp32_matmul(tf32: bool) -> None:
    """How this process's float32 matrix products run on CUDA: on TF32 tensor cores (`model.tf32`)
    or exactly in float32 (torch's default). Each stage sets it from its config where its work runs
    (the GRPO trainer and its rollout process, SFT, evals), so a process that runs several stages
    runs each with its own. Torch's CPU products have a switch of their own, left as torch sets it:
    on a CPU nothing changes."""
    torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"


@contextlib.contextmanager
def one_writer_each() -> Iterator[None]:
    """Torch's deterministic mode off inside, as it was after, for ops whose every output element
    gets at most one write or add: their plain CUDA kernels store the same values every run (no two
    atomics meet at an address), while their deterministic forms are index_put_s whose range check
    synchronised with the host on torch 2.11 (the decoding step's cache write could not be captured
    in a CUDA graph for it): the host waits for the device and then the device for the host. Used for
    that cache write (`StaticDecoder._capture`) and the one-hot add of the head's backward
    (`trainer.rl.logprobs`). Not thread-safe: the mode is global."""
    strict = torch.are_deterministic_algorithms_enabled()
    if not strict:
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(strict, warn_only=warn_only)


def init_distributed(timeout_s: float | None = None) -> None:
    """Join the launcher's process group, or make a one-rank group for a plain process. `timeout_s`:
    how long the rendezvous and each collective wait on another rank before they fail (torch's default,
    30 minutes, when None): what bounds a stage whose rank died or whose host went silent."""
    import datetime

    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    owner = os.environ.get(_OWNER)
    if owner is not None and owner != str(os.getpid()):
        # A one-rank group's settings inherited from the process that made them (a test runner,
        # a Prefect worker): that process may still hold the port, so this one picks its own.
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
    if "MASTER_PORT" not in os.environ:
        os.environ[_OWNER] = str(os.getpid())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    skip_shm_comm_build()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deterministic()
    if torch.cuda.is_available():
        # each rank's own GPU: DeepSpeed places the model there, and NCCL's collectives use it
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    if timeout_s:
        # the groups DeepSpeed makes later (ZeRO's data-parallel group: new_group without a timeout) take
        # torch's default, 30 minutes, read from these at each new_group: they get the same bound
        import torch.distributed.distributed_c10d as c10d

        c10d.default_pg_timeout = timeout["timeout"]
        c10d.default_pg_nccl_timeout = timeout["timeout"]
    one_rank = os.environ.get(_OWNER) == str(os.getpid())  # a group this module made up
    rendezvous = os.environ.get(RENDEZVOUS) or (rendezvous_file() if one_rank else None)
    if rendezvous:
        # On one machine the ranks meet through a file, not a TCP store (which listens on every
        # interface), and gloo talks over loopback: nothing of a local run is reachable from outside.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                device_id=device() if torch.cuda.is_available() else None, **timeout)
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **timeout)


RENDEZVOUS = "POSTTRAIN_RENDEZVOUS_FILE"  # set by the supervisor for ranks launched on this machine alone


_RENDEZVOUS_PREFIX = "posttrain-rendezvous-"


def rendezvous_file() -> str:
    """A fresh path for one group's FileStore (it must not exist before the group starts), in the
    temp folder and named after this machine and process, which removes it when the group is gone
    (FileStore does when a one-rank group ends, trainer.launch when its launcher exits). A process
    killed before that leaves its file behind: each call first removes this machine's whose process
    is gone. (The machine's name keeps a container that shares the temp folder, with processes this
    one cannot see, from taking another's live file for a dead one.)"""
    import tempfile
    import uuid

    from trainer.procwatch import sweep_dead

    temp, mine = Path(tempfile.gettempdir()), f"{_RENDEZVOUS_PREFIX}{socket.gethostname()}-"
    sweep_dead(temp, mine)
    return str(temp / f"{mine}{os.getpid()}-{uuid.uuid4().hex}")


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed from JIT-building its CPU shared-memory all-reduce when a group starts.

    The build runs under torch's lock file in ~/.cache/torch_extensions; a process killed while it
    holds that lock (a SIGKILLed run, a rank the supervisor stops) leaves the file behind, and every
    later run on the machine then waits for it forever. The op serves only DeepSpeed's
    inference_all_reduce, which training never calls, so without it nothing changes but the wait.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def device() -> torch.device:
    """Where this process computes: its rank's GPU when there is one (the one `init_distributed`
    selected), else the CPU. Batches, evaluated models and collectives' tensors go there."""
    deterministic()  # before the first work of a process that starts no group (eval)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def ds_config(ds: DeepSpeedConfig, micro_batch: int, grad_accum: int, grad_clip: float) -> dict[str, Any]:
    """DeepSpeed's config for a stage. bf16 at ZeRO stage 0 or 1 runs DeepSpeed's BF16_Optimizer: bf16
    weights, gradients accumulated in fp32 and fp32 master weights, flat, one clip and one optimizer
    step over them all. DeepSpeed gives it at stage 1 only, so stage 0 asks for 1 (with one rank
    there is nothing to partition; with several the fp32 master weights are split between ranks).
    Left to itself DeepSpeed would run stage 0 in bf16 through its fp16 optimizer, unfused (each
    parameter's overflow check, norm and copies apart: about 25 operators a parameter a step, and a
    device synchronisation for each, against 2 here; docs/gpu.md), and stage 1 through the ZeRO
    optimizer with bf16 gradients. Each parameter's gradient joins the fp32 sum as the backward pass
    makes it (`immediate_grad_update`): DeepSpeed's other way, adding the bf16 gradients after each
    backward, never clears them between micro-batches here, so the earlier ones were added again
    (a 1.8x gradient over 3 micro-batches, tests/test_grpo_update.py). Stages 2 and 3 keep
    DeepSpeed's defaults."""
    bf16 = ds.precision == "bf16"
    stage = ds.zero_stage
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": 1 if bf16 and stage == 0 else stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if bf16 and stage <= 1:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["bf16"]["immediate_grad_update"] = True
    return config


MALLOC_TUNING = "POSTTRAIN_MALLOC_TUNING"  # "0": leave glibc's allocator as it is
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc malloc.h)
_malloc_tuned = False


def retain_freed_memory() -> bool:
    """Keep glibc from handing freed training buffers back to the OS between steps.

    A training step allocates and frees the same few-megabyte activations and gradients every time.
    glibc serves blocks above its mmap threshold with fresh mappings and trims the heap's free top
    back to the OS, so every step faults those pages in again, each zero-filled (docs/performance.md has
    the count and its cost). With the mmap threshold at 64 MiB and the trim threshold at 1 GiB, freed
    blocks are reused instead. Memory once used stays with the process, and the peak RSS grows
    with it: blocks up to 64 MiB come from the heap, whose free pieces do not always fit the next
    step's (smollm2-135m GRPO with LoRA and grpo.gradient_checkpointing: 5.4 GiB peak RSS for
    2.2 GiB in use, 3.6 GiB without this; docs/lora.md). No effect off glibc or with
    POSTTRAIN_MALLOC_TUNING=0, the setting for a run whose peak memory matters more than its
    speed. Returns whether the setting took."""
    global _malloc_tuned
    if _malloc_tuned or os.environ.get(MALLOC_TUNING, "1") == "0":
        return _malloc_tuned
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, 64 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _malloc_tuned


def initialize(model: torch.nn.Module, optimizer, scheduler, config: dict[str, Any]):
    import deepspeed

    retain_freed_memory()
    init_distributed()
    # At ZeRO stage 0 in fp32 DeepSpeed clips with its own clip_grad_norm_ and keeps no gradient norm
    # (`get_global_grad_norm` is None there): its clipping is left off and `step` clips instead
    clip = None
    if config["zero_optimization"]["stage"] == 0 and not config["bf16"]["enabled"]:
        clip, config = float(config["gradient_clipping"]), {**config, "gradient_clipping": 0.0}
    with _no_forced_memory_reports():
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
    if engine.zero_optimization_stage() == 0 and world_size() == 1:
        # One rank without ZeRO has no gradient to reduce, but DeepSpeed's backward would still copy
        # every gradient into flat buckets, "all-reduce" them alone and copy them back: a pass over all
        # of them each step, and about 1,500 operators on a 30-layer model (tests.gpu_profile ops)
        engine.enable_backward_allreduce = False
    if type(engine.optimizer).__name__ == "BF16_Optimizer" and world_size() == 1:
        lean_bf16_optimizer(engine.optimizer)
    engine.posttrain_clip = clip  # None: DeepSpeed clips (and keeps the norm)
    engine.posttrain_grad_norm = None
    return engine, optimizer, scheduler


@contextlib.contextmanager
def _no_forced_memory_reports():
    """DeepSpeed's BF16_Optimizer logs memory as it sets up (at its start and end, and around each
    parameter group), forced (`see_memory_usage(..., force=True)`), and each report first runs a
    full `gc.collect()`: about 0.5 s each in a process holding many objects (a test worker, a
    flow's process). The reports only log; here they are skipped."""
    from deepspeed.runtime import bf16_optimizer

    forced = bf16_optimizer.see_memory_usage
    bf16_optimizer.see_memory_usage = lambda message, force=False: None
    try:
        yield
    finally:
        bf16_optimizer.see_memory_usage = forced


def lean_bf16_optimizer(opt) -> bool:
    """DeepSpeed's BF16_Optimizer (bf16 at ZeRO stage 0 or 1, `ds_config`) with a constant number of
    operators a step instead of a few a parameter, the same arithmetic. Its fp32 gradients are views
    of one flat buffer a parameter group; DeepSpeed works on them a parameter at a time:

    - each parameter's gradient hook casts the bf16 gradient to a new fp32 tensor and adds it through
      views (5 operators, 2 of them kernels, and an allocation): here one `add_` of the bf16 gradient
      into a view made once, which computes in fp32 from the exact upcast, so the same bits;
    - the step takes each gradient's norm (2 operators a parameter), then, when the clip acts, scales
      each one (2 more): here one norm and one scale over the group's gradients back to back (the
      flat buffer less its alignment padding). The norm is the same sum of squares in another order:
      equal up to float rounding, and the same every run.

    On SmolLM2 (273 parameters) that is about 1,090 fewer operators in the backward and 550 to 1,100
    in the step (tests.gpu_profile ops); a GPU's bf16 update waits on the host issuing them
    (docs/gpu.md). For one rank (`initialize`: several ranks keep DeepSpeed's own, not tested with
    this); left as DeepSpeed makes it with model or expert parallelism, Muon, or gradients added after
    the backward. Returns whether it changed anything."""
    if (opt.mpu is not None or opt.has_moe_layers or getattr(opt, "_uses_muon", False)
            or not opt.immediate_grad_update or not opt.using_real_optimizer):
        return False
    for hook in opt._grad_acc_hooks:
        hook.remove()
    opt._grad_acc_hooks = []

    def accumulate(i: int, j: int, param: torch.Tensor):
        hp = opt.fp32_groups_gradients[i][j]  # flat, a view of the group's buffer
        shaped = hp.view(param.shape)

        def hook(p: torch.Tensor) -> None:
            shaped.add_(p.grad)
            p._hp_grad = hp
            opt.fp32_groups_has_gradients[i][j] = True  # clear_hp_grads replaces the inner lists
            p.grad = None  # the fp32 sum holds it now (DeepSpeed's own hook frees it too)
        return hook

    for i, group in enumerate(opt.bf16_groups):
        for j, param in enumerate(group):
            if param.requires_grad:
                opt._grad_acc_hooks.append(param.register_post_accumulate_grad_hook(accumulate(i, j, param)))
    flat = opt.fp32_groups_actual_gradients_flat  # a group's gradients back to back, no padding

    def grads_for_norm(for_clipping: bool = False):
        return list(flat) if for_clipping else (list(flat), {})

    opt.get_grads_for_norm = grads_for_norm
    return True


def step(engine) -> None:
    """`engine.step()`; at an accumulation boundary where DeepSpeed keeps no gradient norm (ZeRO stage
    0 in fp32, `initialize`), the gradients (already averaged over ranks by the boundary's backward)
    are first clipped by torch's clip_grad_norm_, one pass that also gives their norm before clipping."""
    clip = engine.posttrain_clip
    if clip is not None and engine.is_gradient_accumulation_boundary():
        params = [p for p in engine.module.parameters() if p.grad is not None]
        if clip > 0:
            engine.posttrain_grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            engine.posttrain_grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    engine.step()


def grad_norm(engine) -> float:
    """The global gradient norm before clipping at the engine's last optimizer step (NaN before any)."""
    norm = engine.posttrain_grad_norm if engine.posttrain_clip is not None else engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


@contextlib.contextmanager
def full_weights(engine) -> Iterator[dict[str, torch.Tensor] | None]:
    """The policy's full weights by name, as a plain model holds them (a LoRA policy merged), on rank
    0 (None on the others), gathered first while ZeRO-3 partitions them (every rank must enter)."""
    import deepspeed

    from trainer import lora

    module = engine.module
    stage = engine.zero_optimization_stage()
    params = list(module.parameters()) if stage == 3 else []
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
        yield lora.plain_state(module) if rank() == 0 else None


def export_model(engine, tokenizer, out_dir: str | Path, adapter_dir: str | Path | None = None) -> None:
    """save_pretrained of the full (unpartitioned) weights, from rank 0. A LoRA policy is saved merged
    (a plain model every engine and stage loads), and its adapter alone into `adapter_dir` when given."""
    from trainer import lora

    module = engine.module
    with full_weights(engine) as state:
        if state is not None:
            lora.inner(module).save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(str(out_dir))
            if adapter_dir is not None and lora.adapted(module):
                module.save_pretrained(str(adapter_dir), safe_serialization=True)


def state_dict_hash(module: torch.nn.Module) -> str:
    """Hash of the full weights (gathered first when ZeRO-3 partitions them)."""
    import hashlib

    import deepspeed

    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
        h = hashlib.sha256()
        for name, tensor in sorted(module.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- collectives (no-ops on one rank)

def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any: ranks must agree on when to stop a loop."""
    import torch.distributed as dist

    if world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device())  # NCCL reduces GPU tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_across_ranks(values: list[float]) -> list[float]:
    import torch.distributed as dist

    if world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    import torch.distributed as dist

    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if world_size() > 1:
        dist.barrier()
