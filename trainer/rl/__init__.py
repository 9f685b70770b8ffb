"""The RL side of the core: what a rollout is and how it becomes a loss.

    trajectory.py    Sample / Group / RolloutBatch (token ids, loss mask, sampler log-probs,
                     policy version); pack() and rows() for the update
    losses.py        the loss terms as pure functions in one table; advantages, aggregation
    logprobs.py      the update's forward passes (shared-prompt and per-sequence)
    orchestrator.py  data buffer, over-sampling, rewards, the dynamic filter, carry-over
    rewards.py       reward functions and their mix

The engines that produce the tokens (in process on CPU and CUDA, HF's fallback, SGLang) are
`trainer.inference`, below this package. `trainer.grpo` (the trainer) and `trainer.loop` (the round)
sit above it; every import here points down, and nothing imports Prefect or MLflow.
"""
