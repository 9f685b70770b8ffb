"""The fixed-shape decoder, for GPUs: `trainer.inference.cpu`'s arithmetic at shapes that do not
change from step to step, so that each decoding step is captured once as a CUDA graph and replayed
(`StaticDecoder`'s docstring; measured in docs/gpu.md). Off CUDA the same step runs eagerly: that is
how the CPU suite checks it (`tests/test_fixed_decoder.py`)."""

from __future__ import annotations

import logging
import os
import types
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

from trainer.engine import one_writer_each
from trainer.inference.cpu import SUPPORTED, FastDecoder, _Layer, _linear, _rms, _rotate, distinct, left_pad, pick

log = logging.getLogger(__name__)


def race(scores: torch.Tensor) -> torch.Tensor:
    """One token per row with probability softmax(scores) (the Gumbel-max draw): the row's argmax of
    scores + G, G = -log(-log U) with U uniform on [0, 1), one U a token. Elementwise passes and one
    reduction, no prefix sum. U = 0 gives G = -inf (that token is not drawn: a bias of 2^-24 at
    most); a -inf score is never drawn."""
    return (scores - torch.rand_like(scores).log_().neg_().log_()).argmax(-1)


def _captured(run: Callable[[], torch.Tensor | None], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
    """`run` captured as a CUDA graph in memory pool `pool`, after two warm-up runs on a side stream
    (as capture requires: lazy initialisations done, off the stream being captured); the graph and
    what the captured run returned (its output tensor, rewritten by every replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def _fast_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`_rms` in fewer kernels for the GPU (the decoding step; the update's norms, `fuse_norms`):
    torch's fused RMSNorm, then the weight (HF's order of casts and roundings; the sum of squares in
    the fused kernel's own order, which may differ from `pow().mean()` in the last bit of float32).
    One kernel each way in float32, two in bf16 (the weight's product apart)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return _rms(x, weight, eps)  # one fused kernel already
    # rms_norm computes in float32 whatever its input (CUDA's kernel and the CPU's operators alike)
    # and rounds once to the input's dtype: HF's x.float(), its product by rsqrt and the cast back in
    # one kernel, where casting first and last would be two more (the same bits, forward and
    # backward: tests/test_fused_norms.py, on an H200 too)
    return weight * F.rms_norm(x, weight.shape, None, eps)


# Where a model's RMSNorm layers take torch's fused kernel (`fuse_norms`). Only CUDA builds of torch
# have one: on the CPU `rms_norm` is the same eight operators again, and the CPU's training passes
# (trainer.fasttrain) have their own norm.
FUSED_NORM_DEVICES = ("cuda",)


def _fused_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.device.type in FUSED_NORM_DEVICES:
        return _fast_rms(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def fuse_norms(model: torch.nn.Module) -> int:
    """Lets `model`'s RMSNorm layers run torch's fused kernel where their input is on a device in
    FUSED_NORM_DEVICES, and their own forward elsewhere; returns how many layers. Llama-family models
    only (trainer.inference.cpu.SUPPORTED, under a peft wrapper too): their norms all compute
    transformers' LlamaRMSNorm.

    That norm is eight operators forward in bf16 (two casts, pow, mean, add, rsqrt, two products) and
    about ten backward; on a GPU the update is bound by the host issuing operators, and a 30-layer
    model has 61 norms. The fused one is the GPU decoder's own (`_fast_rms`): one operator each way
    in float32, two forward in bf16 (the weight's product apart, in transformers' order).
    The sum of squares is the fused kernel's, which may differ from pow().mean() in the last bit.
    Weights, state dict and saved folders do not change; copies (copy.deepcopy) keep the fused
    forward, bound to the copy."""
    from trainer.lora import inner

    if getattr(getattr(inner(model), "config", None), "model_type", None) not in SUPPORTED:
        return 0
    n = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and weight is not None \
                and weight.dim() == 1:
            m.forward = types.MethodType(_fused_norm_forward, m)
            n += 1
    return n


GRAPHS_ENV = "POSTTRAIN_CUDA_GRAPHS"  # "0": the fixed-shape decoder runs its step eagerly on CUDA too
WIDTH_STEP = 64  # cache widths, and the widths a step attends, round up to a multiple of this (few graphs)
MAX_GRAPHS = 4   # captured shapes kept (each holds its KV cache: layers x 2 x rows x width x kv x head_dim)
PREFILL_STEP = 64  # a prefill's width rounds up to a multiple of this (more left padding): few prefill graphs
MAX_PREFILLS = 4  # prefill shapes kept, each with its graph and its keys and values (layers x rows x width)
CHECK_EVERY = 8  # without stop strings, how many steps between the host's look at whether all rows ended


def bucket(n: int) -> int:
    """A batch of n rows decodes as the next power of two (filler rows beside it, their tokens dropped):
    at most a few shapes a run, each captured once."""
    return 1 << max(0, (n - 1).bit_length())


def _kv(dec: "StaticDecoder", rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's keys [layers, rows, kv, hd, width] and values [layers, rows, kv, width, hd],
    zeroed, in one tensor each."""
    dev, dtype, n = dec.embed.device, dec.embed.dtype, len(dec.layers)
    return (torch.zeros(n, rows, dec.kv_heads, dec.head_dim, width, dtype=dtype, device=dev),
            torch.zeros(n, rows, dec.kv_heads, width, dec.head_dim, dtype=dtype, device=dev))


def _lru(store: dict, key, limit: int, make: Callable[[], object]):
    """store[key], made if missing (the least recently used entry dropped beyond `limit`), moved to
    the end: a dict kept in order of last use."""
    value = store.pop(key, None)
    if value is None:
        if len(store) >= limit:
            store.pop(next(iter(store)))
        value = make()
    store[key] = value
    return value


class _Fixed:
    """One shape's decoding state, in place across steps (a captured graph reads these tensors):
    the KV caches, each row's last token and its position, the cache column the step writes, and
    which columns each row sees."""

    def __init__(self, dec: "StaticDecoder", rows: int, width: int) -> None:
        dev, dtype = dec.embed.device, dec.embed.dtype
        # every layer's keys and values in one tensor each, so that a prefill's are copied in by one
        # op (`StaticDecoder.decode`); a layer's are views of them
        self.keys, self.values = _kv(dec, rows, width)
        self.caches = list(zip(self.keys, self.values))
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.valid = torch.zeros(rows, width, dtype=torch.bool, device=dev)
        # every step writes its logits here, eager or replayed, and the advance reads them here
        self.logits = torch.zeros(rows, dec.head.shape[0], dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the step captured, per width it attends
        # what `StaticDecoder._advance` keeps on the device between steps: the step index, every
        # step's tokens and log-probs so far (a column a step), which rows have ended, and the
        # call's sampling settings as tensors (so one captured advance serves every call of its mode)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.columns = torch.arange(width, device=dev)
        self.out_tok = torch.zeros(rows, width, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(rows, width, dtype=torch.float32, device=dev)
        self.ended = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(1, dtype=torch.float32, device=dev)
        self.min_new = torch.zeros(1, dtype=torch.long, device=dev)
        self.advances: dict[tuple, torch.cuda.CUDAGraph | None] = {}  # per sampling mode; None: eager


class _Prefill:
    """One prefill shape's tensors, in place across calls (a captured prefill reads and writes
    these): the distinct prompts' ids, positions and which columns hold tokens; each prompt's
    last-position logits, and every layer's keys [layers, rows, kv, hd, width] and values
    [layers, rows, kv, width, hd]."""

    def __init__(self, dec: "StaticDecoder", rows: int, width: int) -> None:
        dev, dtype = dec.embed.device, dec.embed.dtype
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, width, dtype=torch.long, device=dev)
        self.valid = torch.zeros(rows, width, dtype=torch.bool, device=dev)
        self.logits = torch.zeros(rows, dec.head.shape[0], dtype=dtype, device=dev)
        self.keys, self.values = _kv(dec, rows, width)
        self.graph: torch.cuda.CUDAGraph | None = None


class StaticDecoder(FastDecoder):
    """The decoder at fixed shapes, for GPUs: a decoding step is launch-bound there (a 135M model
    reads its weights in about 0.1 ms; its few hundred small kernels take milliseconds to launch from
    Python), so each step is captured once as a CUDA graph and replayed.

    - The batch runs as a power-of-two bucket of rows and the KV cache as a width rounded up to
      `WIDTH_STEP`. A step writes its keys and values at a cache column held in a tensor, reads
      positions from a tensor, and attends the cache's first columns, a multiple of `WIDTH_STEP`
      wide that holds every column written so far, under a mask: nothing in a step depends on a
      Python number but that width, so one graph a width (captured the first time a call reaches
      it) serves every step of that width and every later call of the same shape. Attention reads
      the whole attended width of the cache, so attending only what is filled (rounded up) reads
      less of it than attending the whole cache would.
    - A prompt shared by a group's samples is prefilled once, and its cache rows copied to the
      samples. The prefill is captured too, a graph per prefill shape (the distinct prompts a
      power-of-two bucket, the width rounded up to `PREFILL_STEP` by more left padding): run
      eagerly it is a few thousand operators, tens of milliseconds of the host's time a call.
    - Sampling, the sampler's log-probs, EOS, `min_new` and the step's bookkeeping (the token fed
      back, the cache column, positions, the columns each row sees) are a second captured graph per
      sampling mode (`_advance`), replayed after each step: between two replays the host issues
      nothing. Without stop strings it looks every `CHECK_EVERY` steps whether every row has ended
      (one sync), with them every step (the text is decoded on the host).
    - Finished rows decode on (fixed shapes); their tokens past EOS or a stop are dropped.
    - The graph reads the weights where they were at capture: a weight whose storage moved (a
      resume's `load_state_dict` into new tensors, DeepSpeed replacing `.data`) is noticed at the
      next call, and every shape is captured again.

    Off CUDA, or with POSTTRAIN_CUDA_GRAPHS=0, the same step runs eagerly: that is how the CPU tests
    check it against HF `generate` and the trainer's forward (the CPU itself uses `FastDecoder`).
    Replaying a graph runs the same kernels on the same shapes, so decoding stays reproducible run to
    run under torch's deterministic mode."""

    devices = ("cpu", "cuda")

    def __init__(self, model: torch.nn.Module, graphs: bool | None = None) -> None:
        super().__init__(model)  # (kept by `decoder_for` for the model's lifetime: it holds no reference to it)
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.use_graphs = on_cuda and os.environ.get(GRAPHS_ENV, "1") != "0" if graphs is None else graphs
        if self.use_graphs and not on_cuda:
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.masked_writes: bool | None = None  # None: one-hot column writes on CUDA under deterministic mode
        self.fuse = True  # q, k, v as one product and gate, up as one, from weights copied at each call
        self.width_graphs = True  # a step attends the filled columns (rounded up), not the cache's whole width
        self.graph_advance = True  # sampling and the step's bookkeeping captured too (False: eagerly, for profiles)
        self.graph_prefill = True  # the prefill captured too (False: eagerly, for profiles)
        self.prefills: dict[tuple[int, int], _Prefill] = {}  # in order of last use
        self.fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []  # per layer: wqkv, bqkv, wgu
        self.shapes: dict[tuple[int, int], _Fixed] = {}  # in order of last use
        self.weights_at_capture: tuple[int, ...] = ()
        self.pool = None

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the decoder's model was freed")
        return model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)

    def _refresh_fused(self) -> None:
        """Each layer's q, k and v projections as one [(heads + 2 kv_heads) * hd, H] matrix (and bias),
        gate and up as one [2 I, H]: one product each instead of three and two (on a GPU a decoding
        step is a few hundred small kernels, and each is time). They are buffers of the decoder's own,
        allocated once and refilled from the policy's weights at every call (a device-to-device copy
        of about two thirds of them), so the captured graphs keep reading the same storage and the
        call decodes with the weights as they were when it began."""
        first = self.layers[0].wq
        if not self.fused or (self.fused[0][0].dtype, self.fused[0][0].device) != (first.dtype, first.device):
            self.fused = []
            for L in self.layers:
                wqkv = torch.empty(L.wq.shape[0] + L.wk.shape[0] + L.wv.shape[0], L.wq.shape[1], dtype=L.wq.dtype,
                                   device=L.wq.device)
                bqkv = torch.empty(wqkv.shape[0], dtype=L.bq.dtype, device=L.bq.device) if L.bq is not None else None
                wgu = torch.empty(2 * L.wg.shape[0], L.wg.shape[1], dtype=L.wg.dtype, device=L.wg.device)
                self.fused.append((wqkv, bqkv, wgu))
        for L, (wqkv, bqkv, wgu) in zip(self.layers, self.fused):
            torch.cat([L.wq, L.wk, L.wv], out=wqkv)
            if bqkv is not None:
                torch.cat([L.bq, L.bk, L.bv], out=bqkv)
            torch.cat([L.wg, L.wu], out=wgu)

    def _weight_pointers(self) -> tuple[int, ...]:
        ts = [self.embed, self.head, self.norm[0], self.cos, self.sin]
        for L in self.layers:
            ts += [L.ln1[0], L.ln2[0], L.wo, L.wd] + ([] if self.fuse else [L.wq, L.wk, L.wv, L.wg, L.wu])
            ts += [t for t in (L.bq, L.bk, L.bv, L.bo) if t is not None]
            ts += [n[0] for n in (L.qn, L.kn) if n is not None]
        if self.fuse:
            ts += [t for layer in self.fused for t in layer if t is not None]
        return tuple(t.data_ptr() for t in ts)

    def _fixed(self, rows: int, width: int) -> _Fixed:
        """The state of that shape (its steps are captured as they are first run: `_run`)."""
        return _lru(self.shapes, (rows, width), MAX_GRAPHS, lambda: _Fixed(self, rows, width))

    def _prefill(self, pf: _Prefill) -> None:
        """pf's prompts through the model (`FastDecoder._forward`'s arithmetic, the q, k, v and the
        gate, up products fused): every layer's keys and values into pf.keys and pf.values, the last
        position's logits into pf.logits. A padding column attends itself alone (no row of -inf)."""
        R, W = pf.ids.shape
        nh, nkv, hd, g = self.heads, self.kv_heads, self.head_dim, self.groups
        h = F.embedding(pf.ids, self.embed)
        cos, sin = self.cos[pf.positions].unsqueeze(2), self.sin[pf.positions].unsqueeze(2)  # [R, W, 1, hd]
        causal = torch.ones(W, W, dtype=torch.bool, device=h.device).tril()
        mask = (causal & pf.valid[:, None]) | torch.eye(W, dtype=torch.bool, device=h.device)  # [R, W, W]
        mask = mask[:, None] if g == 1 else mask.repeat(1, g, 1)[:, None]  # [R, 1, g W, W]: a KV head's queries
        fused = self.fused if self.fuse else [None] * len(self.layers)
        for i, (L, fz) in enumerate(zip(self.layers, fused)):
            q, k, v = self._layer_qkv(L, h, cos, sin, fz)
            pf.keys[i].copy_(k.permute(0, 2, 3, 1))
            pf.values[i].copy_(v.transpose(1, 2))
            qg = q.view(R, W, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(R, nkv, g * W, hd)
            o = F.scaled_dot_product_attention(qg, pf.keys[i].transpose(2, 3), pf.values[i], attn_mask=mask,
                                               scale=self.scaling)
            h = self._layer_out(L, h, o.view(R, nkv, g, W, hd).permute(0, 3, 1, 2, 4).reshape(R, W, nh * hd), fz)
        self._head_into(h[:, -1], pf.logits)

    def _head_into(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The logits of hidden states h [rows, H], written into `out` (F.linear's own products)."""
        x = _fast_rms(h, *self.norm)
        if self.head_bias is None:
            return torch.mm(x, self.head.t(), out=out)
        return torch.addmm(self.head_bias, x, self.head.t(), out=out)

    def _run_prefill(self, pf: _Prefill) -> None:
        """`_prefill`, replayed (captured the first time: its warm-up runs are the prefill itself,
        on the inputs already in place) or eagerly. Captured under the run's own deterministic
        mode: the prefill has no op whose deterministic form syncs with the host."""
        if not (self.use_graphs and self.graph_prefill):
            return self._prefill(pf)
        if pf.graph is None:
            try:
                pf.graph, _ = _captured(lambda: self._prefill(pf), self._graph_pool())
            except RuntimeError as e:  # an op this torch cannot capture here: the prefill runs eagerly
                log.warning("CUDA graph capture of the prefill failed, it runs eagerly: %s", e)
                torch.cuda.synchronize()
                self.graph_prefill = False
                return self._prefill(pf)
        pf.graph.replay()

    def _graph_pool(self):
        """The memory pool every graph of this decoder is captured in (they never run at once)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _attended(self, st: _Fixed, col: int) -> int:
        """How many cache columns the step that writes column `col` attends: the columns up to it,
        rounded up to a multiple of WIDTH_STEP (no more than the cache has); the cache's whole
        width where `width_graphs` is off."""
        width = st.valid.shape[1]
        return min(width, (col // WIDTH_STEP + 1) * WIDTH_STEP) if self.width_graphs else width

    def _capture(self, st: _Fixed, width: int) -> None:
        """Capture st's step at that attended width, in the middle of a call: the capture's warm-up
        runs compute the step itself on st's state (the keys and values it writes at st's column and
        the logits are what the replay then writes again; nothing else moves). Under torch's
        deterministic mode the step is captured with the mode off, which changes one op: the cache
        write keeps CUDA's plain index_copy_ kernel (its deterministic form is an index_put_ that
        checks the indices on the host, a sync a graph cannot hold; the eager step writes by a one-hot
        select instead, a pass over the attended cache a layer). One column, one writer per element:
        the plain kernel stores the same values every replay. The mode is restored before anything
        else runs (capture is synchronous, on this thread)."""
        with one_writer_each():
            st.graphs[width], _ = _captured(lambda: self._step(st, width), self._graph_pool())

    def _advance(self, st: _Fixed, logits: torch.Tensor, mode: tuple) -> None:
        """Choose step st.t's token of every row from `logits` and move st to the next step, in
        tensor ops only (no host read, no Python number that changes from call to call), so that it
        can be captured: the token and its log-prob written at column st.t of the outputs, EOS
        noted, the token fed back at the next cache column, one position on.

        `mode` is (greedy, top_p in use, log-probs kept, eos, min_new in use); the temperature,
        top_p and min_new values are read from st's tensors. Tokens are chosen by `pick`, as the
        CPU decoder's are, but drawn by `race`, in elementwise passes (the CPU decoder's inverse CDF
        is a prefix sum along each row: on a GPU a long sequential scan over the vocabulary for each
        few rows)."""
        greedy, nucleus, keep_lp, eos, hold_eos = mode
        scores = logits.float()
        if not greedy:
            scores = scores / st.temperature
        lp_all = torch.log_softmax(scores, dim=-1) if keep_lp else None
        if hold_eos:
            scores[:, eos] = torch.where(st.t < st.min_new, float("-inf"), scores[:, eos])
        nxt = pick(scores, greedy, st.top_p if nucleus else None, race)
        at = (st.columns == st.t)[None]  # step t's output column, one-hot
        torch.where(at, nxt[:, None], st.out_tok, out=st.out_tok)
        if lp_all is not None:
            torch.where(at, lp_all.gather(1, nxt[:, None]), st.out_lp, out=st.out_lp)
        st.ended |= nxt == eos
        st.tok.copy_(nxt)
        st.t += 1
        st.col += 1
        st.valid |= (st.columns == st.col)[None]
        st.pos += 1

    def _advancer(self, st: _Fixed, mode: tuple) -> torch.cuda.CUDAGraph | None:
        """st's captured `_advance` for that sampling mode, captured the first time (before the
        call sets st's state: the warm-up steps write it). The CUDA generator's state is put back
        after the capture, so a run samples the same numbers whichever call captured (a resumed run
        captures at another round than the uninterrupted one). None: it runs eagerly (no graphs, or
        the capture failed)."""
        if not self.use_graphs or not self.graph_advance:
            return None
        if mode not in st.advances:
            rng = torch.cuda.get_rng_state()
            try:
                st.advances[mode], _ = _captured(lambda: self._advance(st, st.logits, mode), self._graph_pool())
            except RuntimeError as e:  # an op this torch cannot capture here: sample eagerly
                log.warning("CUDA graph capture of the sampling step failed, it runs eagerly: %s", e)
                torch.cuda.synchronize()
                st.advances[mode] = None
            finally:
                torch.cuda.set_rng_state(rng)
        return st.advances[mode]

    def _run(self, st: _Fixed, width: int) -> torch.Tensor:
        """st's step attending `width` columns, replayed (captured the first time) or eagerly; the
        logits, in st.logits."""
        if self.use_graphs and width not in st.graphs:
            try:
                self._capture(st, width)
            except RuntimeError as e:  # an op this torch cannot capture: the same step, eagerly
                log.warning("CUDA graph capture failed, decoding steps run eagerly from now on "
                            "(%s=0 skips the attempt): %s", GRAPHS_ENV, e)
                self.use_graphs = False
                torch.cuda.synchronize()
        if not self.use_graphs:
            return self._step(st, width)
        st.graphs[width].replay()
        return st.logits

    def _step(self, st: _Fixed, width: int) -> torch.Tensor:
        """Logits [rows, V] of the next token of every row, written into st.logits: `st.tok` at
        position `st.pos`, its keys and values written at cache column `st.col`, attending the
        first `width` columns where `st.valid` marks them."""
        rows = st.valid.shape[0]
        h = F.embedding(st.tok, self.embed)[:, None]  # [rows, 1, H]
        cos, sin = self.cos[st.pos][:, None, None], self.sin[st.pos][:, None, None]  # [rows, 1, 1, hd]
        # additive, shared by every layer: 0 where a key is visible, -inf where not
        mask = torch.zeros((rows, self.heads, width), dtype=h.dtype, device=h.device).masked_fill_(
            ~st.valid[:, None, :width], float("-inf")).view(rows * self.kv_heads, self.groups, width)
        # Under torch's deterministic mode, CUDA's index_copy_ becomes an index_put_ that checks its
        # indices' range on the host (a sync each layer); eagerly, a one-hot select of the column
        # writes the same values with an elementwise op (one more pass over the cache). `_capture`
        # captures with the mode off, so graphs keep index_copy_.
        sel = (torch.arange(width, device=h.device) == st.col) if self._masked_writes(h.device) else None
        fused = self.fused if self.fuse else [None] * len(self.layers)
        for L, (kc, vc), fz in zip(self.layers, st.caches, fused):
            h = self._fixed_block(L, h, cos, sin, kc[..., :width], vc[:, :, :width], st.col, mask, sel, fz)
        return self._head_into(h[:, -1], st.logits)  # where the advance reads them

    def _masked_writes(self, device: torch.device) -> bool:
        if self.masked_writes is not None:
            return self.masked_writes
        return device.type == "cuda" and torch.are_deterministic_algorithms_enabled()

    def _fixed_block(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                     vc: torch.Tensor, col: torch.Tensor, mask: torch.Tensor,
                     sel: torch.Tensor | None = None, fused=None) -> torch.Tensor:
        """One layer of a decoding step at fixed shapes: `_block`'s arithmetic for one new position,
        its keys and values written at the cache column `col` holds (or `sel`, that column's one-hot
        over the width, marks), attending every column of kc and vc (views of the caches' first
        columns); `fused` (`_refresh_fused`'s buffers of this layer) makes q, k, v one product and
        gate, up another."""
        B = h.shape[0]
        nkv, hd, width = self.kv_heads, self.head_dim, kc.shape[-1]
        q, k, v = self._layer_qkv(L, h, cos, sin, fused)
        k, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)  # [B, kv, hd, 1], [B, kv, 1, hd]
        if sel is None:
            kc.index_copy_(3, col, k)
            vc.index_copy_(2, col, v)
        else:
            torch.where(sel, k, kc, out=kc)
            torch.where(sel[:, None], v, vc, out=vc)
        scores = torch.baddbmm(mask, q.reshape(B * nkv, self.groups, hd), kc.view(B * nkv, hd, width),
                               alpha=self.scaling)
        o = torch.softmax(scores, dim=-1) @ vc.view(B * nkv, width, hd)
        return self._layer_out(L, h, o.view(B, 1, self.heads * hd), fused)

    def _layer_qkv(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_qkv`, through the fused product where `fused` (the layer's `_refresh_fused` buffers) is given."""
        return self._qkv(L, h, cos, sin) if fused is None else self._qkv_fused(L, h, cos, sin, fused)

    def _layer_out(self, L: _Layer, h: torch.Tensor, o: torch.Tensor, fused) -> torch.Tensor:
        """`_out_mlp`, through the fused gate and up product where `fused` is given."""
        return self._out_mlp(L, h, o) if fused is None else self._out_mlp_fused(L, h, o, fused)

    def _out_mlp_fused(self, L: _Layer, h: torch.Tensor, o: torch.Tensor, fused) -> torch.Tensor:
        """`_out_mlp` with gate and up as one product (`_refresh_fused`)."""
        h = h + F.linear(o, L.wo, L.bo)
        gate, up = F.linear(_fast_rms(h, *L.ln2), fused[2]).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, L.wd)

    def _qkv_fused(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_qkv` with the three projections as one product (`_refresh_fused`)."""
        B, S, _ = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(_fast_rms(h, *L.ln1), fused[0], fused[1])
        qk, v = qkv.split([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk, v = qk.view(B, S, nh + nkv, hd), v.view(B, S, nkv, hd)
        if L.qn is not None:
            qk = torch.cat([_fast_rms(qk[:, :, :nh], *L.qn), _fast_rms(qk[:, :, nh:], *L.kn)], dim=2)
        qk = _rotate(qk, cos, sin)
        return qk[:, :, :nh], qk[:, :, nh:], v

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], max_new: int, eos: int, pad: int, temperature: float = 0.0,
               top_p: float = 1.0, min_new: int = 0, logprobs: bool = True,
               stop: Callable[[list[int]], bool] | None = None,
               ) -> tuple[list[list[int]], list[list[float]]]:
        """As `FastDecoder.decode`: the new tokens of each prompt (ending at EOS or at a token after
        which `stop` is true, both kept, or at max_new) and their log-probs under softmax(logits / T)."""
        self._pack()
        self.kernel = None  # torch ops: the compiled kernels are CPU code
        if self.fuse:
            self._refresh_fused()
        if self.use_graphs:
            pointers = self._weight_pointers()
            if pointers != self.weights_at_capture:
                self.shapes.clear()  # captured against weights that moved: capture again
                self.prefills.clear()
                self.weights_at_capture = pointers
        B = len(prompts)
        out_tok: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        width = max(len(p) for p in prompts)
        max_new = min(max_new, max(0, self.max_positions - width))
        if max_new == 0:
            return out_tok, out_lp
        dev = self.embed.device
        rows_n = bucket(B)
        cols = min(-(-(width + max_new) // WIDTH_STEP) * WIDTH_STEP, self.max_positions)
        st = self._fixed(rows_n, cols)
        padded = list(prompts) + [prompts[0]] * (rows_n - B)  # filler rows share row 0's prefill
        # the prefill's width rounds up (more left padding, never attended); the cache keeps the
        # prompts' own width, so the steps attend no more columns for it
        wide = min(-(-width // PREFILL_STEP) * PREFILL_STEP, self.max_positions)
        ids, valid = left_pad(padded, pad, width=wide)
        positions = (valid.cumsum(-1) - 1).clamp(min=0)
        rows, inverse = distinct(padded)
        prefill_rows = bucket(len(rows))
        pf = _lru(self.prefills, (prefill_rows, wide), MAX_PREFILLS, lambda: _Prefill(self, prefill_rows, wide))
        rows += [rows[0]] * (pf.ids.shape[0] - len(rows))  # filler prompts, their results unused
        pf.ids.copy_(ids[rows])
        pf.positions.copy_(positions[rows])
        pf.valid.copy_(valid[rows].bool())
        self._run_prefill(pf)
        inverse = inverse.to(dev)
        logits = pf.logits[inverse]
        cut = wide - width  # each row's prompt's keys and values, every layer's, without the extra padding
        st.keys[..., :width].copy_(pf.keys[:, inverse, ..., cut:])
        st.values[:, :, :, :width].copy_(pf.values[:, inverse, :, cut:])
        valid = torch.cat([valid[:, cut:], torch.zeros(rows_n, cols - width, dtype=valid.dtype)], 1).bool().to(dev)
        mode = (temperature <= 0, temperature > 0 and top_p < 1.0, logprobs, eos, min_new > 0)
        advance = self._advancer(st, mode)  # before the state is set: a capture's warm-up writes it
        st.valid.copy_(valid)
        st.pos.copy_(positions[:, -1])  # _advance moves each of these one step on before the step runs
        st.col.fill_(width - 1)
        st.t.zero_()
        st.ended.zero_()
        st.temperature.fill_(temperature if temperature > 0 else 1.0)
        st.top_p.fill_(top_p)
        st.min_new.fill_(min_new)
        stopped = [False] * B  # stop strings: rows whose text ended, as the host decodes it
        steps = max_new
        for t in range(max_new):
            if advance is None:
                self._advance(st, logits, mode)
            else:
                if t == 0:
                    st.logits.copy_(logits)  # the prefill's logits, where the captured advance reads them
                advance.replay()
            if stop is not None:
                for r, tok in enumerate(st.tok[:B].tolist()):
                    if not stopped[r]:
                        out_tok[r].append(tok)
                        stopped[r] = tok == eos or stop(out_tok[r])
            if t == max_new - 1:
                break
            if all(stopped) if stop is not None else (t + 1) % CHECK_EVERY == 0 and bool(st.ended[:B].all()):
                steps = t + 1
                break
            logits = self._run(st, self._attended(st, width + t))  # this step writes column width + t
        toks = st.out_tok[:B, :steps].tolist()
        got = st.out_lp[:B, :steps].tolist() if logprobs else None
        for r in range(B):
            n = len(out_tok[r]) if stop is not None else (toks[r].index(eos) + 1 if eos in toks[r] else steps)
            out_tok[r] = toks[r][:n]
            out_lp[r] = got[r][:n] if got is not None else []
        return out_tok, out_lp
