"""The real instruct model (SmolLM2-135M-Instruct, from its GGUF file) on a real SGLang CPU server,
as `rollout.engine: sglang` runs it: greedy answers identical to the in-process engine's (the fast
decoder) and per-token log-probs within the tolerance below, generation ending at `<|im_end|>`, and
one GRPO round (rollout through the server, reward, update, weights pushed back) after which the
server serves the trained policy.

Tolerance: served in fp32, as the policy; on one machine (2 cores, AVX-512) the same greedy
tokens' log-probs differed by at most 1.8e-5, 2.1e-6 on average (printed by the first test), the
six greedy answers identical; the asserts allow other CPUs' rounding over 30 layers: 2e-3 max,
2e-4 mean.
"""

from __future__ import annotations

import time

import pytest

from tests.test_sglang_server import compare, cpu_server_config
from trainer.inference.sglang import SGLangEngine

pytestmark = pytest.mark.slow

MAX_DIFF, MEAN_DIFF = 2e-3, 2e-4
SYSTEM = "Solve the problem. End with a line '#### <answer>'."
QUESTIONS = ["What is 2+3? Reply with the number only.", "Name one colour.",
             "Dee has 3 pens. Dee gets 1 more. How many pens does Dee have now?",
             "Ivy has 4 shells. The pile grows 6 times bigger. How many shells does Ivy have now?",
             "Ben has 9 cards. Ben loses 5. How many cards does Ben have now?",
             "Jo has 7 eggs. Jo gets 2 more. How many eggs does Jo have now?"]


@pytest.fixture(scope="module")
def server(smollm2):
    folder, _, tok = smollm2
    t0 = time.perf_counter()
    # a request's bound is not what these tests test: 6 answers of a 30-layer model beside the other pytest
    # worker's load took past 120 s on a 2-core AVX2 EPYC
    engine = SGLangEngine.from_config(cpu_server_config(1, request_timeout_s=900), str(folder), tok, dtype="float32")
    print(f"\nSGLang CPU server on SmolLM2-135M healthy in {time.perf_counter() - t0:.1f}s")
    yield engine
    engine.close()


def prompts(tok) -> list[list[int]]:
    from trainer.chat import encode_prompt

    out = [encode_prompt(tok, [{"role": "user", "content": q}]) for q in QUESTIONS[:2]]
    return out + [encode_prompt(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
                  for q in QUESTIONS[2:]]


def greedy(engine, ids, n: int = 64):
    from trainer.inference.engines import SamplingParams

    return engine.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0))


def test_greedy_answers_match_the_fast_decoder_and_stop_at_im_end(server, smollm2):
    from trainer.inference import generate as gen
    from trainer.inference.engines import HFEngine

    _, model, tok = smollm2
    ids = prompts(tok)
    assert gen.decoder_for(model) is not None  # the in-process engine runs the fast decoder on this model
    hf, sg = greedy(HFEngine(model, tok), ids), greedy(server, ids)
    same, max_d, mean_d = compare(hf, sg)
    print(f"\nSmolLM2 greedy agree {same}/{len(ids)}; logprob |diff| max {max_d:.2e} mean {mean_d:.2e}")
    assert same == len(ids), [(a.text, b.text) for a, b in zip(hf, sg) if a.token_ids != b.token_ids]
    assert max_d < MAX_DIFF and mean_d < MEAN_DIFF
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert sg[0].finish_reason == "stop" and "5" in sg[0].text and "<|im_end|>" not in sg[0].text
    assert sum(g.finish_reason == "stop" for g in sg) >= 3  # half end by themselves within 64 tokens here
    for g in sg:  # the stop token ends the sequence the trainer sees (it learns to emit it), once, and not the text
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == im_end and im_end not in g.token_ids[:-1]
        else:
            assert im_end not in g.token_ids and len(g.token_ids) == 64


def test_one_grpo_round_through_sglang_on_the_real_weights(server, smollm2, smollm2_gguf, tmp_path):
    from trainer.config import SyntheticData, load_config
    from trainer.data import synthetic
    from trainer.grpo import GRPOTrainer
    from trainer.model import load_model
    from trainer.inference.engines import HFEngine

    folder, _, tok = smollm2
    cfg = load_config("smollm2-135m", {
        "model.pretrained": str(smollm2_gguf), "rollout.engine": "sglang", "rollout.prompts_per_round": 2,
        "rollout.n_samples_per_prompt": 4, "rollout.max_response_tokens": 32, "rollout.dynamic_filter": "none",
        "grpo.micro_batch_size": 8, "grpo.lr": 1e-4, "grpo.warmup_rounds": 0,
        "grpo.rewards": [{"name": "tests.test_sglang_server:digit_share"}]})
    data = synthetic(SyntheticData(n_train=32, n_test=4, max_ops=1), seed=0)
    for ex in data.train + data.test:
        ex["messages"].insert(0, {"role": "system", "content": SYSTEM})
    ids = prompts(tok)
    before = greedy(server, ids, 24)
    trainer = GRPOTrainer(cfg, load_model(folder), tok, data.train, data.test, tmp_path, engine=server)
    try:
        batch = trainer.score(trainer.rollout())
        assert len(batch.samples) == 8 and all(s.engine_logprobs for s in batch.samples)
        stats = trainer.update(batch)
        assert stats["update/optimizer_steps"] == 1 and stats["update/grad_norm"] > 0
        trainer.publish(stats)
        after = greedy(server, ids, 24)
        assert [g.token_ids for g in after] != [g.token_ids for g in before]  # the server serves the new policy
        same, max_d, mean_d = compare(greedy(HFEngine(trainer.ds.module, tok), ids, 24), after)
        assert same == len(ids) and max_d < MAX_DIFF and mean_d < MEAN_DIFF
    finally:
        trainer.engine = HFEngine(trainer.ds.module, tok)  # the module's server is closed by its fixture
        server.update_weights(str(folder))


def test_weights_by_tensor_and_from_disk_serve_the_same_policy(server, smollm2, tmp_path):
    """The two ways a round's weights reach the server (rollout.sglang.weight_sync), on the real
    model: the same perturbed weights sent by tensor and saved then loaded from disk serve the same
    greedy answers; the seconds each took are printed (a round's sync)."""
    import torch

    folder, model, tok = smollm2
    ids = prompts(tok)
    base = greedy(server, ids, 24)
    gen = torch.Generator().manual_seed(0)
    weights = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    try:
        t0 = time.perf_counter()
        server.update_weights_from_tensors(weights)
        by_tensor = time.perf_counter() - t0
        tensor_answers = greedy(server, ids, 24)
        server.update_weights(str(folder))
        t0 = time.perf_counter()
        model.save_pretrained(str(tmp_path / "sync"), state_dict=weights, safe_serialization=True)
        tok.save_pretrained(str(tmp_path / "sync"))
        server.update_weights(str(tmp_path / "sync"))
        from_disk = time.perf_counter() - t0
        disk_answers = greedy(server, ids, 24)
        print(f"\nSmolLM2 weights to the server: by tensor {by_tensor:.2f} s, saved and loaded from disk {from_disk:.2f} s")
        assert [g.token_ids for g in tensor_answers] == [g.token_ids for g in disk_answers]
        assert [g.token_ids for g in tensor_answers] != [g.token_ids for g in base]
    finally:
        server.update_weights(str(folder))
