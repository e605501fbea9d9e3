"""`rollout.backend = "vllm"`: G completions per prompt sampled by a vLLM server (rl/sampling.py's
protocol), token ids in and out, with the learner's current weights published to the server before
every rollout that follows an optimizer step.

- Prompts go as token ids, one request per group (`n = G`, `return_token_ids`, per-token log-probs),
  all of a round's groups in flight at once so the server batches them. A group's request carries a
  seed drawn from its generator (the one the local sampler would use), so a resumed run samples what
  it would have.
- The server's log-probs are the learner's convention, log_softmax(logits / T) before truncation:
  `--logprobs-mode processed_logprobs`, or with top-p/top-k (which vLLM's processed log-probs are
  renormalised after) `raw_logprobs`, the same at T = 1; top-p/top-k at another temperature are
  refused (server.logprobs_mode).
- The server hands no K/V: the engine runs its prefill (engine.reuse_rollout_kv is refused).
- Publishing the weights (`WeightPublisher`): full weights are written as safetensors and reloaded in
  place by the server's worker extension (rl/vllm/worker_ext.py: re-ties and repacks a tied head on
  a CPU server), between /pause and /resume, with the prefix cache reset (cached prompt K/V of the
  old weights would be reused otherwise); a LoRA policy publishes its adapter instead
  (/v1/load_lora_adapter, load_inplace). Each rollout records the weight version it sampled with.
- Under torchrun every rank is a client of one server, which rank 0 starts (or connects to); each
  rank sends the requests of its own groups. Publishing is a collective: the weights are gathered
  whole from their FSDP shards, rank 0 writes them and has the server reload them, and every rank
  waits for it before sampling (`WeightPublisher`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import shutil
import time

import torch
from torch import Tensor

from backstream.checkpoint import quiet
from backstream.checks import UserError
from backstream.log import log
from backstream.quant.export import write_compressed
from backstream.rl.agent.episodes import EpisodeSampler
from backstream.rl.parallel import DataParallel
from backstream.rl.rollout import Rollout, SamplingConfig, completion_reward_inputs
from backstream.rl.vllm.server import SERVED_NAME, Server, VLLMConfig, free_port, server_args
from backstream.stream import fsdp
from backstream.stream.hf import base_model

ADAPTER = "policy-lora"  # the served name of a LoRA policy's adapter


def sampling_args(config: SamplingConfig) -> dict:
    """rollout.stop, top_p and top_k for the server: a completion ends with the token that completes a
    stop string, and keeps it (the local sampler's convention: vLLM's returned ids then end with that
    token)."""
    out = {"stop": list(config.stop), "include_stop_str_in_output": True} if config.stop else {}
    if config.top_p < 1:
        out["top_p"] = config.top_p
    if config.top_k > 0:
        out["top_k"] = config.top_k
    return out


def _choice(ch: dict, eos: list[int]) -> tuple[list[int], Tensor, str]:
    """A completion choice of the server: its token ids, their log-probs and how it ended ("eos",
    "length", or "stop" for a stop string)."""
    ids, lps = ch["token_ids"], ch["logprobs"]["token_logprobs"]
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
    reason = "eos" if ids and ids[-1] in eos else "length" if ch["finish_reason"] == "length" else "stop"
    return ids, torch.tensor([math.nan if x is None else x for x in lps], dtype=torch.float32), reason


def _base_names(model, state: dict) -> dict:
    """The base model's weights under its own names, from `model`'s state dict: PEFT's prefix and
    wrappers removed (`x.base_layer.weight` is `x.weight`; the adapters' own tensors left out)."""
    base = base_model(model)
    prefix = next(name for name, m in model.named_modules() if m is base)
    prefix = prefix + "." if prefix else ""
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in state.items()
            if k.startswith(prefix) and ".lora_" not in k}


def starting(progress, n: int):
    """A sampler's `progress` told of the server's start-up (seconds so far), or None."""
    if progress is None:
        return None
    return lambda seconds: progress(0, n, f"starting the vLLM server, {seconds:.0f} s")


class WeightPublisher:
    """The server's side of a run: started (or connected to) at the first rollout with the policy's
    weights, and handed the learner's new weights before any rollout after they changed.

    Under torchrun (`dp`: the run's rl/parallel.py object) every rank is a client of one server, and
    `ensure` is a collective that every rank calls at every rollout round (an empty share too): rank
    0 starts the server (or connects to vllm.url) and the others learn its URL; whether the weights
    changed is decided over every rank (versions are counted per shard); the whole weights are
    gathered from their FSDP shards, rank 0 writes them and has the server reload them, and no rank
    samples before it is done. Rank 0's errors (the server did not start, a reload failed) are raised
    on every rank; so are a rank's failed requests, through `dp.fail_together` after each round."""

    def __init__(self, cfg: VLLMConfig, tokenizer, run_dir: str, seed: int, dp: DataParallel | None = None,
                 mode: str = "processed_logprobs", quant=None):
        self.cfg, self.tok, self.run_dir, self.seed, self.mode = cfg, tokenizer, run_dir, seed, mode
        # QaRL: the run's [quant] when the sampler runs low-bit weights: the server gets them compressed
        self.quant = quant if quant is not None and quant.enabled else None
        self.dp = dp if dp is not None else DataParallel(None)
        self.dir = os.path.join(run_dir, "vllm")
        self.log_path = os.path.join(run_dir, "vllm.log")
        self.server: Server | None = None
        self.seen: tuple | None = None  # this rank's versions of the weights the server holds
        self.version = 0  # how many times weights were published (0: the initial ones)
        self.lora = False
        self.sync_s = 0.0  # seconds the last `ensure` spent publishing weights
        if not cfg.url:
            self.dp.on_main(cfg.interpreter)  # no vLLM environment: said now, before the run folder is written

    def model_name(self) -> str:
        return ADAPTER if self.lora else SERVED_NAME

    def ensure(self, model, progress=None) -> Server:
        """The server, holding `model`'s current weights (`sync_s`: what publishing them took now);
        `progress(seconds)` while it starts."""
        self.sync_s = 0.0
        if self.server is None:
            self._start(model, progress)
        elif self.dp.any(fsdp.versions(model) != self.seen):  # a shard changed on some rank: every rank publishes
            t = time.perf_counter()
            self._publish(model)
            self.sync_s = time.perf_counter() - t
        return self.server

    def _start(self, model, progress) -> None:
        self.lora = hasattr(model, "peft_config")
        timeout = self.cfg.request_timeout_s
        if self.cfg.url:
            # the user's server holds unknown weights: ours are published now
            self.server = self.dp.on_main(lambda: Server.connect(self.cfg.url, timeout)) or \
                Server(self.cfg.url, None, None, timeout)
            self._publish(model)
            return
        weights = fsdp.full_state_dict(model)  # every rank: the base model's, whole, on rank 0
        self.server = self.dp.on_main(lambda: self._launch(model, _base_names(model, weights), progress))
        url = self.dp.broadcast(self.server.url if self.server is not None else None)
        if self.server is None:  # a client of rank 0's server, whose log is in the shared run folder
            self.server = Server(url, None, self.log_path, timeout)
        if self.lora:
            self._publish(model)
        else:
            self.seen = fsdp.versions(model)

    def _launch(self, model, weights: dict, progress) -> Server:
        """Rank 0: the server, started from `weights` (the base model's, under its own names)."""
        base = base_model(model)
        initial = os.path.join(self.dir, "initial")
        shutil.rmtree(initial, ignore_errors=True)
        self._write(model, weights, initial, self.tok)
        dtype = str(next(v.dtype for v in weights.values() if v.is_floating_point())).removeprefix("torch.")
        length = self.cfg.max_model_len or getattr(base.config, "max_position_embeddings", 2048)
        rank = max(c.r for c in model.peft_config.values()) if self.lora else 0
        log.info(f"vllm: starting the server (its log: {self.log_path})")
        return Server.start(self.cfg, server_args(initial, free_port(), length, dtype, self.seed, rank, self.mode),
                            self.log_path, progress)

    def _publish(self, model) -> None:
        weights = fsdp.full_state_dict(model, trainable_only=self.lora)  # every rank; whole on rank 0
        # rank 0 writes and reloads; the others wait for it in `on_main`, so none samples old weights
        self.dp.on_main(lambda: self._reload(model, weights))
        self.version += 1
        self.seen = fsdp.versions(model)

    def _write(self, model, weights: dict, out: str, tokenizer=None) -> None:
        """The base model's weights (`weights`, under its own names) as a folder the server loads: the
        low-bit ones in compressed-tensors with `quant` (as the learner's quantized forward has them,
        from its master weights), else as they are."""
        with quiet():
            if self.quant is not None:
                write_compressed(model, self.quant.format, self.quant.group_size, out, tokenizer)
            else:
                base_model(model).save_pretrained(out, safe_serialization=True, state_dict=weights)
                if tokenizer is not None:
                    tokenizer.save_pretrained(out)

    def _reload(self, model, weights: dict) -> None:
        """Rank 0: `weights` written as safetensors and loaded by the server in place."""
        out = os.path.join(self.dir, f"weights-{self.version + 1}")
        shutil.rmtree(out, ignore_errors=True)
        if self.lora:
            with quiet():
                model.save_pretrained(out, state_dict=weights)  # the adapter alone
            self.server.post("/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": out, "load_inplace": True})
            self.server.post("/reset_prefix_cache")
        else:
            self._write(model, _base_names(model, weights), out)
            self.server.post("/pause?mode=wait")
            try:
                self.server.post("/collective_rpc", {"method": "backstream_reload", "kwargs": {"path": out}})
                self.server.post("/reset_prefix_cache")  # cached prompt K/V are the old weights'
            finally:
                self.server.post("/resume")
        if self.version > 0:
            shutil.rmtree(os.path.join(self.dir, f"weights-{self.version}"), ignore_errors=True)

    @contextlib.contextmanager
    def requests(self):
        """Around the requests each rank sends on its own: an error on any rank (the server died) is
        raised on every rank once each is done (`dp.fail_together`), naming the server's log."""
        error = None
        try:
            yield
        except Exception as e:  # noqa: BLE001  (raised below, on every rank)
            error = e
        self.dp.fail_together(error)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()  # rank 0's; a client's holds no process
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
        server = self.publisher.ensure(model, starting(progress, len(rows)))
        self.sync_s = self.publisher.sync_s
        c, G = self.config, self.config.group_size
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=g)) for g in generators]

        def request(j: int) -> dict:
            body = {"model": self.publisher.model_name(), "prompt": [self.prompts[indices[j]].tolist()], "n": G,
                    "max_tokens": c.max_new_tokens, "temperature": c.temperature, "logprobs": 0,
                    "return_token_ids": True, "seed": seeds[j], "stop_token_ids": self.eos,
                    "skip_special_tokens": False, **sampling_args(c)}
            return server.post("/v1/completions", body)

        out = Rollout(prompt_index=[], prompt_ids=[], completion_ids=[], logprobs=[], finish_reason=[], kv=None,
                      group_size=G, weight_version=[])
        with self.publisher.requests(), \
                concurrent.futures.ThreadPoolExecutor(max_workers=min(64, max(1, len(indices)))) as pool:
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
        server = self.publisher.ensure(model, starting(progress, len(rows)))
        self.sync_s = self.publisher.sync_s
        G, turns = self.config.group_size, self.env_cfg.max_turns
        episodes, seeds, done = [], [], [0]

        def play(k: int) -> None:
            ep = episodes[k]
            self._turn(server, ep, seeds[k][0])
            while self._after_turn(ep):
                ep.add(ep.inserted, None)
                self._turn(server, ep, seeds[k][min(ep.turns, turns - 1)])
            done[0] += 1

        with self.publisher.requests():  # an error in an episode stops the step, on every rank
            for row, index, gen in zip(rows, indices, generators):
                for _ in range(G):  # a seed per turn of each episode, from its group's generator
                    episodes.append(self._start(row, index))
                    seeds.append(torch.randint(0, 2**31 - 1, (turns,), generator=gen).tolist())
            for ep in episodes:
                if len(ep.prompt) >= self.max_tokens:
                    raise UserError(f"env.max_episode_tokens: a prompt of {len(ep.prompt)} tokens leaves no room "
                                    f"for a turn (limit {self.max_tokens}); raise it or shorten the prompt")
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(128, max(1, len(episodes)))) as pool:
                for f in concurrent.futures.as_completed([pool.submit(play, k) for k in range(len(episodes))]):
                    f.result()
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
            "stop_token_ids": list(self.eos), "skip_special_tokens": False, **sampling_args(c)})
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
