"""Agent programs as the run's episodes (`[env] agent` / `agent_command`, issue 34, docs/agentic.md).

`AgentSampler` is the run's sampler (rl/rollout/sampler.py's protocol) when `[env]` names an agent program:
for each task it opens G episodes on the run's OpenAI-compatible endpoint (rl/agent/endpoint.py), runs
the program once per episode (rl/agent/runner.py), every episode of the round at once so that their
requests batch, and turns each episode's transcript (rl/agent/transcript.py) into one sample: the
branch of its last answer is the sample's own sequence, every other branch that sampled a token is
one of its forks (rl/records.py `Fork`), trained with the episode's advantage. Behind the endpoint
samples the run's backend (rl/backends/: `Backend.generate`; in process, requests that arrive while
the model decodes are decoded together next). A request the backend fails is the agent's error, and
the round raises the first once its episodes are over, so a failing backend (a dead server) stops the
step instead of scoring every episode 0.

Rewards: the program's own (a function's return value, a command's last line when it is a number) is
the reward "env", read through each sample's `AgentOutcome` (TRL's `environments` contract); the
run's reward functions score the final conversation (the last answered request's messages after its
first system/user ones, and the answer, whose `finish_reason` says how it ended). A program that
raised, exited non-zero or overran env.agent_timeout_s scores 0 as "env" and is counted
(episode/agent_errors, episode/agent_timeouts); the run goes on.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from dataclasses import dataclass
from operator import attrgetter

import torch

from backstream.checks import UserError
from backstream.log import log
from backstream.rl.agent.endpoint import TOOLS_DROPPED, Endpoint, EpisodeSession
from backstream.rl.agent.runner import AgentResult, run_command, run_function
from backstream.rl.agent.transcript import Branch
from backstream.rl.agent.turns import make_format, prompt_head
from backstream.rl.backends.base import SamplingParams
from backstream.rl.records import Completion, EpisodeInfo, Fork, Round, Samples
from backstream.rl.rollout.sampler import episode_metric_keys, episode_metrics, episode_reward_inputs
from backstream.stream import vision
from backstream.stream.vision import VISION_KEYS
from backstream.usercode import load_object

MEANS = {  # the step's line: the mean over its episodes of each
    "episode/requests/mean": attrgetter("turns"), "episode/branches/mean": attrgetter("branches"),
    "episode/tool_calls/mean": attrgetter("tool_calls"), "episode/agent_errors": attrgetter("agent_error"),
    "episode/agent_timeouts": attrgetter("timed_out"), "episode/agent_seconds/mean": attrgetter("agent_seconds")}


@dataclass
class AgentOutcome:
    """How an episode's program ended, as the reward functions get it (`environments`): `get_reward()`
    is the program's reward (the built-in reward "env"; None: it gave none), 0 for a program that
    failed (`discarded`)."""

    reward: float | None
    error: str | None
    timed_out: bool

    @property
    def discarded(self) -> bool:
        return self.error is not None

    def get_reward(self) -> float | None:
        return self.reward


class AgentRewards:
    """What the run's rewards see of the agent program (rewards.with_env_reward): its reward is "env"."""

    has_reward = True

    def __init__(self, name: str):
        self.name = name
        self.reward_source = f"what {name} returns"


def format_for(env_cfg, tokenizer, eos: list[int]):
    """A request's turn format from its tools: the chat template (env.chat_template, else the
    tokenizer's), or the plain format of a model without one (the built-in default); a template that
    renders earlier turns differently later is taken (a rewritten history is a branch)."""
    def fmt(tools: list[dict]):
        return make_format(env_cfg.format, tokenizer, tools, set(eos), env_cfg.chat_template, check=False)

    fmt([])  # env.format = "chat" without a template: refused now, by name
    return fmt


class AgentSampler:
    """The sampler of an agent program's episodes (see the module docstring); `backend`: the run's."""

    metric_keys = episode_metric_keys(MEANS)

    def __init__(self, config: SamplingParams, group_size: int, env_cfg, tokenizer, eos: list[int], context: int | None,
                 backend, vision=None):
        """`vision`: a vision-language policy's `Pictures` (rl/data/images.py): its agents' `image_url` parts
        are images (rl/agent/endpoint.py)."""
        self.config, self.env_cfg, self.tok, self.eos, self.backend = config, env_cfg, tokenizer, eos, backend
        self.vision = vision
        if vision is not None:
            self.metric_keys = (*self.metric_keys, *VISION_KEYS)
        self.group_size = group_size
        if env_cfg.agent:
            self.fn = load_object(env_cfg.agent, "env.agent")
            if not callable(self.fn):
                raise UserError(f"env.agent {env_cfg.agent!r}: not a function")
        else:
            self.fn = None
        self.name = env_cfg.agent or env_cfg.agent_command
        self.environment = AgentRewards(f"env.agent{'' if env_cfg.agent else '_command'} {self.name}")
        self.format_for = format_for(env_cfg, tokenizer, eos)
        self.context = env_cfg.token_limit(context)
        self.needs = None  # the longest sequence it samples, and why (a server's context: `Sync.need_context`)
        if self.context:
            why = (f"env.max_episode_tokens = {env_cfg.max_episode_tokens}"
                   if self.context == env_cfg.max_episode_tokens else
                   "the model's context (an agent's conversation may grow to it; env.max_episode_tokens bounds it)")
            self.needs = (self.context, why)  # `Sync.need_context`
        self.endpoint: Endpoint | None = None
        self.serving = threading.Lock()  # an asynchronous source samples groups from threads
        self.served_name = "policy"
        self.said_tools = False  # the episodes whose tools the template dropped were said (once a run)

    def _serve(self) -> Endpoint:
        """The endpoint, started at the first round; each episode's requests go to the backend through
        its round (`_Round`)."""
        with self.serving:
            if self.endpoint is None:
                c = self.config
                self.endpoint = Endpoint(self.format_for, _outside_a_round, self.eos[0] if self.eos else None,
                                         self.served_name, c.temperature, c.top_p, c.max_new_tokens, self.context,
                                         self.env_cfg.max_turns, vision=self.vision)
                url = self.endpoint.start()
                log.info(f"env: agent episodes at {url}/episodes/<id>/v1 (127.0.0.1 only), one base URL and key "
                         "each")
            return self.endpoint

    def sample(self, rows: list[dict], indices: list[int], generators: list, progress=None) -> Round:
        G, endpoint = self.group_size, self._serve()
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=gen)) for gen in generators for _ in range(G)]
        results: list[AgentResult | None] = [None] * len(seeds)
        done = [0] * len(rows)
        with self.backend.round(len(seeds)) as requests:
            round_ = _Round(requests)
            gallery = getattr(requests, "gallery", None) if self.vision is not None else None  # the round's images
            sessions = [endpoint.open(seed, round_.generate, gallery) for seed in seeds]
            try:
                with concurrent.futures.ThreadPoolExecutor(max_workers=min(256, max(1, len(sessions)))) as pool:
                    futures = {pool.submit(self._play, s, rows[k // G]): k for k, s in enumerate(sessions)}
                    for f in concurrent.futures.as_completed(futures):
                        k = futures[f]
                        results[k] = f.result()
                        endpoint.finish(sessions[k])
                        requests.finish(sessions[k].id)
                        done[k // G] += 1
                        if progress is not None and done[k // G] == G:
                            progress(sum(d == G for d in done), len(rows))
            finally:
                for s in sessions:
                    endpoint.finish(s)
        if round_.failure is not None:  # the backend failed, not the agent: the step stops
            raise round_.failure
        self._tools_dropped(sessions, results)
        return Round(self._rollout(sessions, results, rows, indices, round_.dtype, gallery))

    def _tools_dropped(self, sessions: list[EpisodeSession], results: list[AgentResult]) -> None:
        """Episodes whose requests' tools the chat template dropped (the endpoint refused them, code
        "tools_not_rendered"): said once, with their count; a round in which every episode failed so
        stops the run (nothing could be learned: the policy never sees a tool)."""
        hit = [k for k, s in enumerate(sessions) if s.refused.get(TOOLS_DROPPED)]
        if not hit:
            return
        text = f"env: {len(hit)} of {len(sessions)} agent episodes had requests refused: {self.endpoint.dropped}"
        if all(results[k].error is not None for k in range(len(sessions))) and len(hit) == len(sessions):
            raise UserError(f"{text}. Every episode of the round failed so: stopping before anything is trained")
        if not self.said_tools:
            self.said_tools = True
            log.warning(text)

    def _play(self, session: EpisodeSession, row: dict) -> AgentResult:
        timeout = self.env_cfg.agent_timeout_s
        if self.fn is not None:
            return run_function(self.fn, session.base_url, session.key, self.served_name, row, timeout)
        return run_command(self.env_cfg.agent_command, session.base_url, session.key, self.served_name, row, timeout)

    def _rollout(self, sessions: list[EpisodeSession], results: list[AgentResult], rows: list[dict],
                 indices: list[int], dtype: torch.dtype, gallery=None) -> Samples:
        """The round's samples; with `gallery` (a VLM's round), each sequence's virtual image ids as the
        real ids and its pictures (`Gallery.real`)."""
        G = self.group_size
        out = Samples(prompt_index=[], prompt_ids=[], completion_ids=[], logprobs=[], finish_reason=[],
                      group_size=G, sampled=[], episodes=[], weight_version=[], forks=[],
                      pictures=[] if self.vision is not None else None)

        def real(ids: list[int]) -> tuple[list[int], list | None]:
            if self.vision is None:
                return ids, None
            if gallery is None or min(ids, default=0) >= 0:
                return ids, vision.Placed([], torch.zeros(len(ids), dtype=torch.bool))
            return gallery.real(ids)

        for k, (s, res) in enumerate(zip(sessions, results)):
            t = s.transcript
            trained = [i for i, b in enumerate(t.branches) if any(b.sampled)]
            main = t.last if t.last in trained else trained[-1] if trained else None
            own = t.branches[main] if main is not None else Branch(ids=[self.eos[0] if self.eos else 0],
                                                                   sampled=[False], logprobs=[math.nan],
                                                                   versions=[-1])
            first = own.sampled.index(True) if any(own.sampled) else len(own.ids)
            own_ids, own_pictures = real(own.ids)
            if out.pictures is not None:
                out.pictures.append(own_pictures)
            out.prompt_index.append(indices[k // G])
            out.prompt_ids.append(torch.tensor(own_ids[:first], dtype=torch.long))
            out.completion_ids.append(torch.tensor(own_ids[first:], dtype=torch.long))
            out.logprobs.append(torch.tensor(own.logprobs[first:], dtype=dtype))
            out.sampled.append(torch.tensor(own.sampled[first:], dtype=torch.bool))
            out.weight_version.append(torch.tensor(own.versions[first:], dtype=torch.long))
            forks = []
            for i, b in enumerate(t.branches):
                if i in trained and i != main:
                    ids, pictures = real(b.ids)
                    forks.append(Fork(torch.tensor(ids, dtype=torch.long), torch.tensor(b.sampled, dtype=torch.bool),
                                      torch.tensor(b.logprobs, dtype=dtype), torch.tensor(b.versions, dtype=torch.long),
                                      pictures=pictures))
            out.forks.append(forks)
            reason = ("timeout" if res.timed_out else "error" if res.error else
                      s.conversation[-1]["finish_reason"] if s.conversation else "stop")
            out.finish_reason.append({"stop": "eos", "tool_calls": "eos"}.get(reason, reason))
            if res.error and not s.refused.get(TOOLS_DROPPED):  # (those are said once: `_tools_dropped`)
                log.warning(f"env: an agent episode of row {indices[k // G]} ended with an error: {res.error}")
            after = [dict(m) for m in s.conversation[prompt_head(s.conversation):]]
            messages = after or [{"role": "assistant", "content": "", "finish_reason": out.finish_reason[-1]}]
            out.episodes.append(AgentEpisodeInfo(
                turns=t.requests, tool_calls=s.tool_calls, tool_errors=0, results_cut=0, timed_out=res.timed_out,
                prompt=rows[k // G].get("prompt"), messages=messages,
                env=AgentOutcome(res.reward if res.error is None else 0.0, res.error, res.timed_out),
                branches=t.divergences(), agent_error=res.error is not None and not res.timed_out,
                agent_seconds=res.seconds))
        return out

    def reward_inputs(self, r: Samples, rows: list[dict]) -> tuple[list, list, dict]:
        """As TRL passes them with an environment: each episode's final conversation after its prompt,
        the task's prompt, each episode's `AgentOutcome`, its completion's ids."""
        return episode_reward_inputs(r)

    def metrics(self, r: Samples) -> dict[str, float]:
        out = episode_metrics(r, MEANS, ended=("length",))
        if r.pictures is not None:  # every sequence's images, forks' included, each image once
            out.update(vision.vision_metrics([*r.pictures, *[f.pictures or [] for fs in r.forks or [] for f in fs]]))
        return out

    def close(self) -> None:
        with self.serving:
            if self.endpoint is not None:
                self.endpoint.stop()
                self.endpoint = None


def _outside_a_round(ids: list[int], max_tokens: int, seed: int, key: str) -> Completion:
    """What samples a request of a session opened outside `AgentSampler.sample` (none is): refused."""
    raise RuntimeError("no round is being sampled: this episode is over")


class _Round:
    """One `sample` call's requests (the backend's round, rl/backends/base.py `Requests`): the first the
    backend failed is kept for that call to raise (rounds of an asynchronous run run side by side: each
    keeps its own), and the log-probs' dtype (float64 for a float64 model) noted."""

    def __init__(self, requests):
        self.requests, self.failure, self.dtype = requests, None, torch.float32

    def generate(self, ids: list[int], max_tokens: int, seed: int, key: str) -> Completion:
        try:
            out = self.requests.generate(ids, max_tokens, seed, key)
        except Exception as e:
            self.failure = self.failure or e
            raise
        self.dtype = torch.promote_types(out.logprobs.dtype, torch.float32)
        return out


@dataclass
class AgentEpisodeInfo(EpisodeInfo):
    """An agent program's episode: its requests are its `turns`; `branches`: how many times its history
    extended none of its branches (divergences); whether its program failed, and its seconds."""

    branches: int = 0
    agent_error: bool = False
    agent_seconds: float = 0.0
