"""What a config needs beyond its own fields, checked once before any stage starts: by the CLI
(before a server starts) and by the flows (a run from the Prefect UI or a deployment). A custom
environment or reward that cannot be imported, a critic folder without a value head or adapters this
model cannot take would otherwise stop the run only when its stage starts, after the stages before
it have run."""

from __future__ import annotations

from trainer.config import RunConfig


def check(cfg: RunConfig) -> None:
    """Raises ConfigError naming the field and the fix."""
    from trainer.rl.critic import check_critic
    from trainer.rl.envs import check_environment
    from trainer.rl.rewards import check_rewards

    from trainer.problems import check_task

    check_task(cfg.task)
    check_environment(cfg.rollout.environment)
    check_critic(cfg.grpo)
    if cfg.grpo.enabled:
        check_rewards(cfg.grpo.rewards)
    if cfg.model.lora is not None:
        from trainer.lora import check_config

        check_config(cfg)


def check_root(cfg: RunConfig) -> None:
    """Raises StorageError where a local artifact_root cannot hold results (a file in its path, a
    folder this user may not write in), before a server starts or an MLflow run is made. The dry
    run lists it among its problems instead; an s3:// root is probed at the run's first write."""
    from trainer import storage

    problem = storage.local_root_problem(cfg.artifact_root)
    if problem:
        raise problem
