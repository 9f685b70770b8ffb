"""The RL side of the core: what a rollout is and how it becomes a loss.

    trajectory.py    Sample / Group / RolloutBatch (token ids, loss mask, sampler log-probs,
                     policy version); pack() and rows() for the update
    losses.py        the loss terms as pure functions in one table; advantages, aggregation
    logprobs.py      the update's forward passes (shared-prompt and per-sequence)
    engines.py       the engine protocol, SamplingParams, the in-process HFEngine
    orchestrator.py  data buffer, over-sampling, rewards, the dynamic filter, carry-over
    rewards.py       reward functions and their mix
    sglang.py        SGLang servers as an engine (sglang_server.py: their launch wrapper)

`trainer.grpo` (the trainer) and `trainer.loop` (the round) sit above it; every import here
points down, and nothing imports Prefect or MLflow.
"""
