"""LoRA adapters (model.lora, through peft): only the adapters train; the in-process engine generates
with them merged in place (the same tokens as computing them at every token, the base restored
after); the merged export is a plain model that answers as the base plus the adapter does; a GRPO
stage stopped and resumed ends with the uninterrupted run's adapters and optimizer; a run through
the CLI, Prefect and MLflow logs and registers the merged model and the adapter; bad settings are
named before anything runs."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer import lora
from trainer.config import ConfigError, LoRAConfig, load_config
from trainer.data import synthetic
from trainer.errors import InputError
from trainer.grpo import GRPOTrainer
from trainer.loop import run_round, run_rounds
from trainer.model import build_model
from trainer.inference.engines import HFEngine, SamplingParams

OVERRIDES = ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
             "grpo.rounds=4", "grpo.checkpoint_every=2", "grpo.eval_every=100", "rollout.prompts_per_round=3",
             "rollout.n_samples_per_prompt=4", "rollout.over_sample=2", "rollout.max_response_tokens=12",
             "rollout.dynamic_filter=none", "grpo.mini_batches=2", "grpo.epochs=2", "grpo.micro_batch_size=4",
             "grpo.lr=1e-2", "grpo.kl_coef=0.05", "model.lora.rank=4",
             "grpo.rewards=[{name: tests.test_grpo_update.digit_share}]"]  # dense: every round moves the adapters


def small_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def with_moved_adapters(model, c: LoRAConfig, seed: int = 1):
    """The model wrapped, its adapters' B (zero at the start) set as if they had trained."""
    wrapped = lora.wrap(model, c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return wrapped


def test_only_the_adapters_train_and_they_start_as_the_model():
    model = small_llama()
    ids = torch.randint(0, 64, (2, 9))
    before = model(input_ids=ids).logits.detach()
    wrapped = lora.wrap(model, LoRAConfig(rank=2))
    assert torch.equal(wrapped(input_ids=ids).logits, before)  # B = 0: the same function
    trained = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    # all-linear: every projection of every layer, not the output head
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    assert sum(p.numel() for n, p in wrapped.named_parameters() if p.requires_grad) == lora.trainable_params(wrapped)


def test_merged_generation_gives_the_tokens_of_the_adapters_computed_at_every_token(tiny_tokenizer):
    """The in-process engine: merged in place (the fast decoder) and unmerged (transformers' forward
    with peft's layers) sample the same tokens; the base weights come back after the merge."""
    model = build_model(load_config("tiny", OVERRIDES).model, tiny_tokenizer, 0)
    wrapped = with_moved_adapters(model, LoRAConfig(rank=4))
    base = {n: p.detach().clone() for n, p in wrapped.named_parameters() if "base_layer" in n}
    prompts = [tiny_tokenizer("What is 3 + 4?")["input_ids"], tiny_tokenizer("7 * 2 =")["input_ids"]]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    merged = HFEngine(wrapped, tiny_tokenizer, merge=True).generate(prompts, params)
    computed = HFEngine(wrapped, tiny_tokenizer, merge=False).generate(prompts, params)
    assert [g.token_ids for g in merged] == [g.token_ids for g in computed]
    with wrapped.disable_adapter():  # the adapters matter: without them, other tokens
        base_only = HFEngine(wrapped, tiny_tokenizer, merge=False).generate(prompts, params)
    assert [g.token_ids for g in merged] != [g.token_ids for g in base_only]
    for n, p in wrapped.named_parameters():
        if n in base:
            assert torch.allclose(p, base[n], atol=1e-6, rtol=0)  # restored up to rounding
    assert lora.unmerged(wrapped)


def test_the_fused_training_pass_computes_the_adapters_as_peft_does():
    """trainer.fasttrain runs a peft model (the base through the compiled products, the adapters
    beside it): the same logits and adapter gradients as the model's own forward, and with the
    adapters switched off (the KL reference) the base's logits."""
    from trainer import fasttrain
    from trainer.rl.logprobs import hf_prefix_logits

    if fasttrain.unsupported(small_llama()) is not None:
        pytest.skip(f"the fused passes cannot run here: {fasttrain.unsupported(small_llama())}")
    wrapped = with_moved_adapters(small_llama(), LoRAConfig(rank=4))
    assert fasttrain.unsupported(wrapped) is None
    g = torch.Generator().manual_seed(0)
    pids = torch.randint(0, 64, (2, 6), generator=g)
    pmask = torch.ones_like(pids)
    pmask[1, :2] = 0  # a left-padded prompt
    inverse, rids = torch.tensor([0, 0, 1]), torch.randint(0, 64, (3, 5), generator=g)
    rmask = torch.ones_like(rids)
    fused = fasttrain.prefix_logits(wrapped, pids, pmask, inverse, rids, rmask)
    own = hf_prefix_logits(wrapped, pids, pmask, inverse, rids, rmask)
    assert torch.allclose(fused, own, atol=1e-5)
    adapters = [p for p in wrapped.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(fused.square().sum(), adapters), torch.autograd.grad(own.square().sum(), adapters)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    with wrapped.disable_adapter():
        off = fasttrain.prefix_logits(wrapped, pids, pmask, inverse, rids, rmask)
        assert torch.allclose(off, hf_prefix_logits(wrapped, pids, pmask, inverse, rids, rmask), atol=1e-5)
    assert not torch.allclose(off, fused, atol=1e-2)  # the adapters mattered


def test_the_merged_weights_are_a_plain_model_that_answers_as_base_plus_adapter(tiny_tokenizer, tmp_path):
    """plain_state: the plain model's names, the adapters folded in; loaded strictly into a model with
    no peft, it computes what the wrapped one does (and the async rollout process takes this state)."""
    wrapped = with_moved_adapters(small_llama(), LoRAConfig(rank=3, alpha=6, target_modules=["q_proj", "down_proj"]))
    state = lora.plain_state(wrapped)
    assert not any("lora_" in k or "base_layer" in k for k in state)
    plain = small_llama(seed=5)
    plain.load_state_dict(state, strict=True)
    ids = torch.randint(0, 64, (3, 11))
    assert torch.allclose(plain(input_ids=ids).logits, wrapped(input_ids=ids).logits, atol=1e-5)
    with lora.merged(lora.inner(wrapped)):  # merged in place, the same weights again
        assert all(torch.allclose(state[k], v.cpu(), atol=1e-6) for k, v in lora.plain_state(wrapped).items())


@pytest.fixture(scope="module")
def data():
    cfg = load_config("tiny", OVERRIDES)
    return synthetic(cfg.data.synthetic.model_copy(update={"n_train": 40, "n_test": 4}), 0)


def run(cfg, tok, data, work, stop_after: int | None = None) -> GRPOTrainer:
    trainer = GRPOTrainer(cfg, build_model(cfg.model, tok, 0), tok, data.train, data.test, work)
    while not trainer.done():
        run_round(trainer)
        if stop_after == trainer.round:
            break
    return trainer


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")  # peft reads a name transformers 5 renamed
@pytest.mark.slow
def test_a_lora_grpo_stage_resumes_to_the_uninterrupted_runs_adapters(tiny_tokenizer, data, tmp_path):
    """Four rounds with a KL term (the reference is the policy with its adapters off): stopped after
    round 3, resumed from the round-2 checkpoint, it ends with the uninterrupted run's weights (base,
    as merged and unmerged each round, and adapters) and the same losses. The optimizer holds the
    adapters only."""
    cfg = load_config("tiny", OVERRIDES)
    full = run(cfg, tiny_tokenizer, data, tmp_path / "full")
    assert full.reference is None  # no copy of the model: the adapters switched off
    state = full.ds.optimizer.state_dict()
    held = sum(p.numel() for group in full.ds.optimizer.param_groups for p in group["params"])
    assert held == lora.trainable_params(full.ds.module) and state
    assert full.history[-1]["update/kl"] > 0  # the adapters moved the policy from the reference
    run(cfg, tiny_tokenizer, data, tmp_path / "crash", stop_after=3)
    resumed = GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test,
                          tmp_path / "crash")
    assert resumed.resumed_from == 2
    run_rounds(resumed)
    assert resumed.state_hash() == full.state_hash()
    assert [h["update/loss"] for h in resumed.history] == [h["update/loss"] for h in full.history]

    # the export: the merged model (a plain folder) and the adapter, which on the starting weights
    # gives the merged model's greedy answers
    full.export(tmp_path / "model", tmp_path / "adapter")
    from peft import PeftModel

    from trainer.inference.generate import generate
    from trainer.model import load_model

    merged = load_model(tmp_path / "model")
    assert not lora.adapted(merged)
    adapter = PeftModel.from_pretrained(build_model(cfg.model, tiny_tokenizer, 0), str(tmp_path / "adapter"))
    prompts = [tiny_tokenizer(ex["messages"][1]["content"])["input_ids"] for ex in data.test]
    a = generate(merged, tiny_tokenizer, prompts, 16, temperature=0.0)
    b = generate(adapter, tiny_tokenizer, prompts, 16, temperature=0.0)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


def test_bad_lora_settings_are_named_before_the_run(tiny_tokenizer, tmp_path, capsys):
    model = small_llama()
    with pytest.raises(InputError, match=r"target_modules: \['qproj'\] name no linear layer.*q_proj, up_proj, v_proj"):
        lora.check(model, LoRAConfig(target_modules=["q_proj", "qproj"]))
    with pytest.raises(InputError, match="matches no linear layer"):
        lora.check(model, LoRAConfig(target_modules="^nothing$"))
    with pytest.raises(InputError, match=r"rank=17 is larger than layer k_proj \(32 -> 16\).*at most 16"):
        lora.check(model, LoRAConfig(rank=17))
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_config("tiny", ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match="model.lora.merge=false with SGLang"):
        load_config("tiny", ["model.lora.merge=false", "rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        load_config("tiny", ["model.lora.target_modules=[]"])
    # a string is a regular expression (peft's): one that does not compile is named when the config loads
    with pytest.raises(ConfigError, match=r"model.lora.target_modules = '\[': not a regular expression "
                                          r"\(unterminated character set"):
        load_config("tiny", ["model.lora={rank: 4, target_modules: '['}"])
    # the CLI: exit 2 with the field and the layers, before any stage runs (nothing written)
    from flows.cli import main

    root = tmp_path / "art"
    code = main(["speedrun", "--preset", "tiny", "--set", f"artifact_root={root}", "--set", "model.lora.rank=64",
                 "--set", "model.hidden_size=32", "--set", "model.intermediate_size=64"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.lora.rank=64 is larger than layer q_proj (32 -> 32)" in err
    assert not root.exists()


def test_the_lora_preset_is_the_smollm2_run_with_adapters_at_thirty_times_its_learning_rate_checkpointed():
    full, adapted = load_config("smollm2-135m").to_dict(), load_config("smollm2-135m-lora").to_dict()
    assert adapted["model"]["lora"] == {**LoRAConfig().model_dump(), "rank": 8, "alpha": 32.0}
    assert adapted["grpo"]["lr"] == pytest.approx(30 * full["grpo"]["lr"])
    assert adapted["grpo"]["gradient_checkpointing"] and not full["grpo"]["gradient_checkpointing"]
    adapted["model"]["lora"], adapted["grpo"]["lr"], adapted["name"] = None, full["grpo"]["lr"], full["name"]
    adapted["grpo"]["gradient_checkpointing"] = False
    assert adapted == full
