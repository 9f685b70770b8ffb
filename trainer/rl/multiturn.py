"""Episodes of several turns through a rollout engine, token in, token out.

Each episode starts from its environment's messages, rendered once by the chat template (with
the tools: through the template where it renders them, else described in a system message). Then,
turn after turn, the engine continues every unfinished episode's tokens; the policy's tokens are
appended as sampled (loss mask 1, their log-probs kept), never decoded and encoded again; the
environment reads the turn's text and answers, and its observation is appended as the template
renders it (loss mask 0): the end of the assistant's turn the policy stopped inside (a tool call's
end is a stop string), the observation messages, and the next assistant header.

An episode ends when the environment says so (the policy answered, `max_turns`), or when the
trajectory reaches `max_tokens` (no room for an observation and another turn); the reason is
the sample's `finish_reason`. A turn cut by `rollout.max_response_tokens` is still the
environment's to answer (a tool call left open is an error the policy reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from trainer.chat import ChatFormatError, render_ids
from trainer.inference.generate import Generation
from trainer.inference.engines import RolloutEngine, SamplingParams
from trainer.rl.envs import Episode, Tool, step_episode
from trainer.rl.tools import TOOL_CALL_END, TOOL_CALL_START

TURN_SEED_STRIDE = 1_000_003  # seed offset between an episode batch's turns


def tools_in_template(tok: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template renders a `tools` list itself (Qwen, Llama 3.1, SmolLM3, Hermes...)."""
    return "tools" in (getattr(tok, "chat_template", None) or "")


def tool_system_message(tools: list[Tool]) -> dict[str, str]:
    """The tools described in a system message, for a template that does not render them: each
    as `name(argument: type, ...): description`, then how to call one."""
    lines = []
    for t in tools:
        fn = t.schema["function"]
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in fn["parameters"].get("properties", {}).items())
        lines.append(f"{fn['name']}({args}): {fn.get('description', '')}")
    return {"role": "system", "content": (
        "Tools: " + " ".join(lines) + " Call one as " + TOOL_CALL_START
        + '{"name": ..., "arguments": {...}}' + TOOL_CALL_END + ".")}


def prompt_ids(tok: PreTrainedTokenizerBase, episode: Episode, describe_tools: bool = True) -> list[int]:
    """The episode's opening messages with its tools described (unless `describe_tools` is off:
    the policy learned them in SFT), and the assistant's generation prompt."""
    messages = list(episode.messages)
    if not episode.tools or not describe_tools:
        return render_ids(tok, messages, True)
    if tools_in_template(tok):
        return render_ids(tok, messages, True, tools=[t.schema for t in episode.tools])
    return render_ids(tok, [tool_system_message(episode.tools)] + messages, True)


class Observations:
    """Tokens that follow a policy turn stopped inside the assistant message: its end-of-turn
    marker, the observation messages, and the next assistant header, as the template renders them.

    Found by rendering a fixed conversation with and without the observation: the tokens the
    template adds after an assistant message's content. The template must render a shorter
    conversation as a token prefix of a longer one (checked, as `trainer.chat` checks it)."""

    PROBE = "ok"

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self.tok = tok
        base = [{"role": "user", "content": "question"}]
        head = render_ids(tok, base, True)
        closed = render_ids(tok, base + [{"role": "assistant", "content": self.PROBE}], False)
        content = tok(self.PROBE, add_special_tokens=False)["input_ids"]
        if closed[: len(head)] != head or closed[len(head) : len(head) + len(content)] != content:
            raise ChatFormatError("the chat template does not render an assistant message as its generation prompt "
                                  "followed by the message's own tokens; multi-turn rollouts need one that does")
        self.base = base + [{"role": "assistant", "content": self.PROBE}]
        self.closed = closed
        self.end_of_turn = closed[len(head) + len(content):]

    def __call__(self, messages: list[dict[str, str]]) -> list[int]:
        full = render_ids(self.tok, self.base + messages, True)
        if full[: len(self.closed)] != self.closed:
            raise ChatFormatError(f"the chat template renders the conversation before a {messages[0]['role']!r} "
                                  "message differently once it follows; multi-turn rollouts need a template that "
                                  "renders earlier turns the same whatever comes after them")
        return self.end_of_turn + full[len(self.closed):]


@dataclass
class Trajectory:
    """An episode being played: the response so far and what it recorded."""

    episode: Episode
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)       # the policy's turns
    turns: list[dict] = field(default_factory=list)      # every turn, for the rollout tables
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    correct: bool | None = None  # the environment's own verdict, where it gives one with its reward
    reason: str = ""

    @property
    def done(self) -> bool:
        return bool(self.reason)

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def tool_use(episodes: list) -> dict[str, float]:
    """Turns and tool use of played episodes (trajectories or samples: anything with `turns`,
    `tool_calls` and `tool_errors`), for the rounds' and the evals' metrics."""
    n = max(len(episodes), 1)
    calls = sum(e.tool_calls for e in episodes)
    errors = sum(e.tool_errors for e in episodes)
    return {"turns_mean": sum(sum(t["role"] == "assistant" for t in e.turns) for e in episodes) / n,
            "tool_calls_mean": calls / n, "tool_errors": float(errors),
            "tool_success_rate": (calls - errors) / calls if calls else 0.0,
            "tool_use_rate": sum(e.tool_calls > 0 for e in episodes) / n}


def play(engine: RolloutEngine, tok: PreTrainedTokenizerBase, episodes: list[Episode], params: SamplingParams,
         max_turns: int, max_tokens: int, observations: Observations, describe_tools: bool = True,
         progress=None) -> list[Trajectory]:
    """Every episode to its end; each turn one engine call over the unfinished ones (in order).
    `progress` (a bar, `update(n)`) counts the episodes as they end."""
    trajs = [Trajectory(e, prompt_ids(tok, e, describe_tools)) for e in episodes]
    stop = tuple(dict.fromkeys(params.stop + (TOOL_CALL_END,)))
    for turn in range(max_turns):
        live = [t for t in trajs if not t.done]
        if not live:
            break
        room = [max_tokens - len(t.ids) for t in live]
        # one call a turn: the longest room any episode has left bounds this turn's tokens
        turn_params = SamplingParams(min(params.max_new_tokens, max(room)), params.temperature, params.top_p,
                                     seed=None if params.seed is None else params.seed + TURN_SEED_STRIDE * turn,
                                     min_new_tokens=params.min_new_tokens if turn == 0 else 0, stop=stop)
        gens: list[Generation] = engine.generate([t.prompt + t.ids for t in live], turn_params)
        for t, g, left in zip(live, gens, room):
            ids, lps = g.token_ids[:left], g.logprobs[: min(left, len(g.token_ids))]
            t.add(ids, list(lps))
            text = tok.decode(ids, skip_special_tokens=True)
            t.texts.append(text)
            t.turns.append({"role": "assistant", "text": text, "trained": True})
            step = step_episode(t.episode, text, turn + 1)
            t.tool_calls += step.tool_calls
            t.tool_errors += step.tool_errors
            if step.reward is not None:
                t.reward = step.reward
                t.correct = step.correct
            if step.done:
                t.reason = step.reason or "done"
                continue
            if len(ids) < len(g.token_ids):
                t.reason = "token_budget"  # the turn was cut at the trajectory's last token
                continue
            for m in step.observation:
                t.turns.append({"role": m["role"], "text": m["content"], "trained": False})
            obs = observations(step.observation)
            if len(t.ids) + len(obs) >= max_tokens:
                t.reason = "token_budget"  # no room for the observation and a turn after it
                continue
            t.add(obs, None)
        if progress is not None:
            progress.update(sum(t.done for t in live))
    cut = [t for t in trajs if not t.done]
    for t in cut:
        t.reason = "max_turns"
    if progress is not None and cut:
        progress.update(len(cut))
    return trajs
