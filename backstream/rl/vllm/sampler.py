"""`rollout.backend = "vllm"`: G completions per prompt sampled by a vLLM server (rl/sampling.py's
protocol), token ids in and out, with the learner's current weights published to the server before
every rollout that follows an optimizer step.

- Prompts go as token ids, one request per group (`n = G`, `return_token_ids`, per-token log-probs),
  all of a round's groups in flight at once so the server batches them. A group's request carries a
  seed drawn from its generator (the one the local sampler would use), so a resumed run samples what
  it would have.
- The server runs `--logprobs-mode processed_logprobs`: log-probs are log_softmax(logits / T), the
  learner's convention. vLLM renormalises them after top-p/top-k truncation, which the learner does
  not: such settings are refused with this backend rather than silently mis-weighted.
- The server hands no K/V: the engine runs its prefill (engine.reuse_rollout_kv is refused).
- Publishing the weights (`WeightPublisher`): full weights are written as safetensors and reloaded in
  place by the server's worker extension (rl/vllm/worker_ext.py: re-ties and repacks a tied head on
  a CPU server), between /pause and /resume, with the prefix cache reset (cached prompt K/V of the
  old weights would be reused otherwise); a LoRA policy publishes its adapter instead
  (/v1/load_lora_adapter, load_inplace). Each rollout records the weight version it sampled with.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
import time

import torch
from torch import Tensor

from backstream.checkpoint import quiet
from backstream.checks import UserError
from backstream.log import log
from backstream.rl.agent.episodes import EpisodeSampler
from backstream.rl.rollout import Rollout, SamplingConfig, completion_reward_inputs
from backstream.rl.vllm.server import SERVED_NAME, Server, VLLMConfig, free_port, server_args
from backstream.stream.hf import base_model

ADAPTER = "policy-lora"  # the served name of a LoRA policy's adapter


def stop_strings(config: SamplingConfig) -> dict:
    """rollout.stop for the server: a completion ends with the token that completes a stop string, and
    keeps it (the local sampler's convention: vLLM's returned ids then end with that token)."""
    return {"stop": list(config.stop), "include_stop_str_in_output": True} if config.stop else {}


def _choice(ch: dict, eos: list[int]) -> tuple[list[int], Tensor, str]:
    """A completion choice of the server: its token ids, their log-probs and how it ended ("eos",
    "length", or "stop" for a stop string)."""
    ids, lps = ch["token_ids"], ch["logprobs"]["token_logprobs"]
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
    reason = "eos" if ids and ids[-1] in eos else "length" if ch["finish_reason"] == "length" else "stop"
    return ids, torch.tensor([math.nan if x is None else x for x in lps], dtype=torch.float32), reason


def _version(model) -> tuple:
    """Changes whenever an optimizer step (or any in-place write) touched a trainable weight."""
    return tuple(p._version for p in model.parameters() if p.requires_grad)


def _plain_state_dict(base) -> dict:
    """The base model's weights under their own names: PEFT's wrappers removed (`x.base_layer.weight`
    is `x.weight`; the adapters' own tensors left out)."""
    return {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}


class WeightPublisher:
    """The server's side of a run: started (or connected to) at the first rollout with the policy's
    weights, and handed the learner's new weights before any rollout after they changed."""

    def __init__(self, cfg: VLLMConfig, tokenizer, run_dir: str, seed: int):
        self.cfg, self.tok, self.run_dir, self.seed = cfg, tokenizer, run_dir, seed
        self.dir = os.path.join(run_dir, "vllm")
        self.server: Server | None = None
        self.seen: tuple | None = None  # the weights' version the server holds
        self.version = 0  # how many times weights were published (0: the initial ones)
        self.lora = False
        self.sync_s = 0.0  # seconds the last `ensure` spent publishing weights
        if not cfg.url:
            cfg.interpreter()  # no vLLM environment: said now, before the run folder is written

    def model_name(self) -> str:
        return ADAPTER if self.lora else SERVED_NAME

    def ensure(self, model) -> Server:
        """The server, holding `model`'s current weights (`sync_s`: what publishing them took now)."""
        self.sync_s = 0.0
        if self.server is None:
            self._start(model)
        elif _version(model) != self.seen:
            t = time.perf_counter()
            self._publish(model)
            self.sync_s = time.perf_counter() - t
        return self.server

    def _start(self, model) -> None:
        self.lora = hasattr(model, "peft_config")
        base = base_model(model)
        if self.cfg.url:
            self.server = Server.connect(self.cfg.url, self.cfg.request_timeout_s)
            self.seen = None  # the user's server holds unknown weights: publish ours now
            self._publish(model)
            return
        initial = os.path.join(self.dir, "initial")
        shutil.rmtree(initial, ignore_errors=True)
        with quiet():  # a LoRA policy: the base model under it, with its own parameter names
            base.save_pretrained(initial, safe_serialization=True, state_dict=_plain_state_dict(base))
        self.tok.save_pretrained(initial)
        dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        length = self.cfg.max_model_len or getattr(base.config, "max_position_embeddings", 2048)
        rank = max(c.r for c in model.peft_config.values()) if self.lora else 0
        log.info(f"vllm: starting the server (its log: {os.path.join(self.run_dir, 'vllm.log')})")
        self.server = Server.start(self.cfg, server_args(initial, free_port(), length, dtype, self.seed, rank),
                                   os.path.join(self.run_dir, "vllm.log"))
        if self.lora:
            self._publish(model)
        else:
            self.seen = _version(model)

    def _publish(self, model) -> None:
        out = os.path.join(self.dir, f"weights-{self.version + 1}")
        shutil.rmtree(out, ignore_errors=True)
        if self.lora:
            with quiet():
                model.save_pretrained(out)  # the adapter alone
            self.server.post("/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": out, "load_inplace": True})
            self.server.post("/reset_prefix_cache")
        else:
            with quiet():
                base_model(model).save_pretrained(out, safe_serialization=True)
            self.server.post("/pause?mode=wait")
            try:
                self.server.post("/collective_rpc", {"method": "backstream_reload", "kwargs": {"path": out}})
                self.server.post("/reset_prefix_cache")  # cached prompt K/V are the old weights'
            finally:
                self.server.post("/resume")
        previous = os.path.join(self.dir, f"weights-{self.version}")
        if self.version > 0:
            shutil.rmtree(previous, ignore_errors=True)
        self.version += 1
        self.seen = _version(model)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class VLLMSampler:
    """The single-turn sampler of `rollout.backend = "vllm"` (see the module docstring)."""

    metric_keys = ("vllm/weight_version",)
    environment = None

    def __init__(self, config: SamplingConfig, tokenizer, eos: list[int], prompts: list[Tensor],
                 prompt_text: list[str], publisher: WeightPublisher):
        self.config, self.tok, self.eos = config, tokenizer, list(eos)
        self.prompts, self.prompt_text, self.publisher = prompts, prompt_text, publisher
        self.sync_s = 0.0

    def check_prompts(self, examples: list[dict]) -> int:
        return max((len(p) for p in self.prompts), default=0)

    def sample(self, model, rows: list[dict], indices: list[int], generators: list, progress=None) -> Rollout:
        server = self.publisher.ensure(model)
        self.sync_s = self.publisher.sync_s
        c, G = self.config, self.config.group_size
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=g)) for g in generators]

        def request(j: int) -> dict:
            body = {"model": self.publisher.model_name(), "prompt": [self.prompts[indices[j]].tolist()], "n": G,
                    "max_tokens": c.max_new_tokens, "temperature": c.temperature, "logprobs": 0,
                    "return_token_ids": True, "seed": seeds[j], "stop_token_ids": self.eos,
                    "skip_special_tokens": False, **stop_strings(c)}
            return server.post("/v1/completions", body)

        out = Rollout(prompt_index=[], prompt_ids=[], completion_ids=[], logprobs=[], finish_reason=[], kv=None,
                      group_size=G, weight_version=[])
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, max(1, len(indices)))) as pool:
            answers = list(pool.map(request, range(len(indices))))
        for j, answer in enumerate(answers):
            prompt = self.prompts[indices[j]]
            choices = sorted(answer["choices"], key=lambda ch: ch["index"])
            for ch in choices:
                ids, logprobs, reason = _choice(ch, self.eos)
                out.prompt_index.append(indices[j])
                out.prompt_ids.append(prompt)
                out.completion_ids.append(torch.tensor(ids, dtype=torch.long))
                out.logprobs.append(logprobs)
                out.finish_reason.append(reason)
                out.weight_version.append(self.publisher.version)
            if progress is not None:
                progress(j + 1, len(indices))
        return out

    def reward_inputs(self, r: Rollout, rows: list[dict]) -> tuple[list, list, dict]:
        return completion_reward_inputs(r, rows, self.tok, self.prompt_text)

    def metrics(self, r: Rollout) -> dict[str, float]:
        return {"vllm/weight_version": float(min(r.weight_version)) if r.weight_version else math.nan}

    def timings(self) -> dict[str, float]:
        return {"sync": self.sync_s}

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass  # the server is the run's (`Samplers.close`)


class VLLMEpisodeSampler(EpisodeSampler):
    """Episodes (`[env]`) played through the server: the environment, the turn format, the limits and
    what the rewards see are the local episode sampler's (rl/agent/episodes.py); only the turns are
    sampled by the server. Each turn is a request whose prompt is exactly the episode's ids so far
    (sampled and inserted tokens, never re-rendered text: the server echoes them and they are
    checked), and every live episode runs in a thread of its own, so all their turns are in flight at
    once and the server batches them; its prefix cache keeps each episode's history."""

    metric_keys = (*EpisodeSampler.metric_keys, "vllm/weight_version", "episode/tool_seconds")

    def __init__(self, config: SamplingConfig, env_cfg, tokenizer, eos: list[int], context: int | None,
                 publisher: WeightPublisher):
        super().__init__(config, env_cfg, tokenizer, eos, False, context)
        self.publisher, self.sync_s = publisher, 0.0

    def sample(self, model, rows: list[dict], indices: list[int], generators: list, progress=None) -> Rollout:
        self.release()
        server = self.publisher.ensure(model)
        self.sync_s = self.publisher.sync_s
        G, turns = self.config.group_size, self.env_cfg.max_turns
        episodes, seeds = [], []
        for row, index, gen in zip(rows, indices, generators):
            for _ in range(G):  # a seed per turn of each episode, from its group's generator
                episodes.append(self._start(row, index))
                seeds.append(torch.randint(0, 2**31 - 1, (turns,), generator=gen).tolist())
        for ep in episodes:
            if len(ep.prompt) >= self.max_tokens:
                raise UserError(f"env.max_episode_tokens: a prompt of {len(ep.prompt)} tokens leaves no room for a "
                                f"turn (limit {self.max_tokens}); raise it or shorten the prompt")
        done = [0]

        def play(k: int) -> None:
            ep = episodes[k]
            self._turn(server, ep, seeds[k][0])
            while self._after_turn(ep):
                ep.add(ep.inserted, None)
                self._turn(server, ep, seeds[k][min(ep.turns, turns - 1)])
            done[0] += 1

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(128, max(1, len(episodes)))) as pool:
            for f in concurrent.futures.as_completed([pool.submit(play, k) for k in range(len(episodes))]):
                f.result()  # an error in an episode stops the step
                if progress is not None and done[0] % G == 0:
                    progress(done[0] // G, len(rows))
        self.tool_s = sum(ep.tool_s for ep in episodes)
        self.fed = [ep.fed for ep in episodes]
        return self._rollout(episodes, indices)

    def _turn(self, server: Server, ep, seed: int) -> None:
        """One turn sampled by the server from the episode's ids so far."""
        ids = list(ep.prompt) + list(ep.ids)
        c = self.config
        answer = server.post("/v1/completions", {
            "model": self.publisher.model_name(), "prompt": [ids], "n": 1, "max_tokens": self._budget(len(ids)),
            "temperature": c.temperature, "logprobs": 0, "return_token_ids": True, "seed": seed,
            "stop_token_ids": list(self.eos), "skip_special_tokens": False, **stop_strings(c)})
        (choice,) = answer["choices"]
        if choice.get("prompt_token_ids") not in (None, ids):
            raise RuntimeError("vLLM answered for other prompt ids than the episode's; the sequence would not be "
                               "what the policy saw")
        tokens, logprobs, reason = _choice(choice, list(self.eos))
        ep.fed = ids + tokens[:-1]
        self._took_turn(ep, tokens, logprobs, reason)

    def _weight_versions(self, episodes) -> list[int]:
        return [self.publisher.version] * len(episodes)

    def metrics(self, r: Rollout) -> dict[str, float]:
        return {**super().metrics(r), "episode/tool_seconds": self.tool_s,
                "vllm/weight_version": float(min(r.weight_version)) if r.weight_version else math.nan}

    def timings(self) -> dict[str, float]:
        # episodes run concurrently: their tool seconds overlap the other episodes' turns, so they are
        # no slice of the step's wall time (episode/tool_seconds has their sum)
        return {"sync": self.sync_s}
