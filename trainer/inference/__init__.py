"""How tokens are produced, whatever the device: every engine and decoder in one place.

    engines.py         the protocol every rollout engine keeps (RolloutEngine: generate(prompts,
                       SamplingParams) -> Generations of token ids, sampler log-probs, finish reason,
                       policy version; set_weights), and the in-process HFEngine
    generate.py        the in-process front door: `generate()` picks the model's fast decoder
                       (`decoder_for`) or falls back to HF `generate`, the portable path any model runs
    cpu.py             FastDecoder: Llama-family decoding on CPU, each step one call of the compiled
                       kernel (`trainer/kernels.py`, `trainer/csrc/`; they stay beside the trainer,
                       whose fused passes use the same build)
    cuda.py            StaticDecoder: cpu.py's arithmetic at fixed shapes, each step captured once as a
                       CUDA graph and replayed (docs/gpu.md)
    sglang.py          SGLang servers as an engine (sglang_server.py: their launch wrapper, run by
                       SGLang's own Python)

The RL core (`trainer.rl`) and the evals import this package; nothing here imports `trainer.rl`,
Prefect or MLflow.
"""
