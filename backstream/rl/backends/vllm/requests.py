"""The generate calls of a run on its vLLM servers: token ids in and out (/inference/v1/generate,
`return_token_ids`), per-token log-probs and weight versions, a request a publish aborted resumed from
its tokens so far (rollout.in_flight = "resume"). A prompt's images go as `content_parts` (PNG data
URLs) after ids with each image as the one token its template renders: the server's processor expands
it (vLLM expands a token prompt's image tokens itself, and would expand an already-expanded prompt
again), and the ids it answers are checked to be the learner's, image tokens included. Which server
takes a request is the pool's (rl/backends/vllm/pool.py), the weights on it the weight sync's
(rl/backends/vllm/weights/); rl/backends/vllm/backend.py puts them behind the backend protocol."""

from __future__ import annotations

import base64
import contextlib
import io
import math
import uuid

import torch

from backstream.checks import UserError
from backstream.rl.backends.base import SamplingParams
from backstream.rl.records import Completion


def sampling_args(config: SamplingParams) -> dict:
    """rollout.stop, top_p and top_k for the server: a completion ends with the token that completes a
    stop string, and keeps it (the local sampler's convention: vLLM's returned ids then end with that
    token)."""
    out = {"stop": list(config.stop), "include_stop_str_in_output": True} if config.stop else {}
    if config.top_p < 1:
        out["top_p"] = config.top_p
    if config.top_k > 0:
        out["top_k"] = config.top_k
    return out


def choice_of(ch: dict, eos: list[int]) -> Completion:
    """A choice of /inference/v1/generate as a `Completion`."""
    ids = ch["token_ids"]
    lps = [x["logprob"] for x in (ch.get("logprobs") or {}).get("content") or []]
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
    versions = torch.empty(len(ids), dtype=torch.long)
    covered = 0
    for span in ch.get("weight_versions") or []:
        try:
            versions[span["start"]:span["end"]] = int(span["version"])
        except ValueError:
            raise RuntimeError(f"vLLM labelled tokens with weight version {span['version']!r}, which no publish of "
                               "this run set (another client changed it: /update_weight_version)") from None
        covered += span["end"] - span["start"]
    if covered != len(ids):
        raise RuntimeError(f"vLLM labelled {covered} of {len(ids)} tokens with a weight version")
    reason = "abort" if ch["finish_reason"] == "abort" else "eos" if ids and ids[-1] in eos else \
        "length" if ch["finish_reason"] == "length" else "stop"
    return Completion(ids, torch.tensor([math.nan if x is None else x for x in lps], dtype=torch.float32), versions,
                   reason)


def collapsed(ids: list[int], pictures, where: str) -> tuple[list[int], list[dict]]:
    """`ids` with each picture's expansion (`Picture.span`, in order) as the one token a template renders
    for it, and the pictures as vLLM's `content_parts`; an expansion not found where the ids hold the
    next image is an error naming `where`."""
    out, parts, i = [], [], 0
    for k, pic in enumerate(pictures):
        span = list(pic.span or ())
        j = i
        while j < len(ids) and ids[j:j + len(span)] != span:
            j += 1
        if not span or j >= len(ids):
            raise UserError(f"{where}: image {k}'s tokens are not in the prompt as the processor expands it alone, "
                            "so a vLLM server's processor would not re-make them; sample it with "
                            "rollout.backend = \"local\"")
        out += ids[i:j] + [pic.token]
        i = j + len(span)
        png = io.BytesIO()
        pic.source.save(png, format="PNG")  # lossless: the server's processor reads the learner's pixels
        parts.append({"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()})
    return out + ids[i:], parts


def resumed_seed(seed: int, choice: int, part: int) -> int:
    """The seed of the `part`-th resumption of choice `choice` of a request seeded `seed`."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(
        (seed * 1_000_003 + choice) * 1_009 + part)))


class ServerRequests:
    """The run's requests (`model`: the name they serve, the base or a LoRA policy's adapter;
    `in_flight`: rollout.in_flight, or "wait"). Thread-safe: an asynchronous run's groups call `generate`
    from threads of their own. `abort` ends the requests in flight on servers of your own when the run
    closes (the ones the run started stop with it)."""

    def __init__(self, model: str, in_flight: str = "wait"):
        self.model, self.in_flight = model, in_flight
        self.sent: dict[str, object] = {}  # ids of the requests in flight -> their server

    def generate(self, member, ids: list[int], params: dict, n: int, seed: int, eos: list[int], pictures=(),
                 where: str = "the prompt") -> list[Completion]:
        """`n` samples after the token ids `ids` on `member`'s server (a pool member: the server, the step
        its weights are labelled with; /inference/v1/generate: token ids in and out, per-token log-probs
        and weight versions); `params`: vLLM's sampling parameters but n and seed; `eos`: the tokens that
        end a sample ("eos"). A sample that a publish aborted (rollout.in_flight = "resume") is resumed
        from its tokens so far, re-prefilled with the new weights, by a request of its own: its tokens
        keep the versions they were sampled with. `pictures`: the images `ids` hold (`where` names the
        prompt in an error)."""
        done = self._request(member, ids, params, n, seed, eos, pictures, where)
        for c, x in enumerate(done):
            while x.reason == "abort":
                left = params["max_tokens"] - len(x.ids)
                if left <= 0:  # aborted with its budget spent: it ended by length
                    x.reason = "length"
                    break
                (part,) = self._request(member, ids + x.ids, {**params, "max_tokens": left}, 1,
                                        resumed_seed(seed, c, len(x.ids)), eos, pictures, where)
                x.ids, x.reason = x.ids + part.ids, part.reason
                x.logprobs = torch.cat([x.logprobs, part.logprobs])
                x.versions = torch.cat([x.versions, part.versions])
        return done

    def _request(self, member, ids: list[int], params: dict, n: int, seed: int, eos: list[int], pictures=(),
                 where: str = "the prompt") -> list[Completion]:
        rid = f"backstream-{uuid.uuid4().hex}"
        sent, parts = collapsed(ids, pictures, where) if pictures else (ids, None)
        body = {"model": self.model, "token_ids": sent, "request_id": rid, "return_token_ids": True,
                "sampling_params": {**params, "n": n, "seed": seed, "logprobs": 0, "skip_special_tokens": False}}
        if parts:
            body["content_parts"] = parts
        if self.in_flight == "keep":  # a publish cannot reset a cache that paused requests hold: keyed by version
            body["cache_salt"] = f"weights-{member.label}"
        self.sent[rid] = member.server
        try:
            answer = member.server.post("/inference/v1/generate", body)
        finally:
            self.sent.pop(rid, None)
        if pictures and answer.get("prompt_token_ids") != ids:
            got = answer.get("prompt_token_ids") or []
            raise UserError(f"{where}: the vLLM server's processor expanded its images into other tokens than the "
                            f"learner's ({len(got)} prompt ids, the learner's {len(ids)}: "
                            f"{sum(t == pictures[0].token for t in got)} image tokens against "
                            f"{sum(t == pictures[0].token for t in ids)}); serve the model folder the run trains, "
                            "with the same processor files")
        if answer.get("prompt_token_ids") not in (None, ids):
            raise RuntimeError("vLLM answered for other prompt ids than those sent; the sequence would not be what "
                               "the policy saw")
        return [choice_of(ch, eos) for ch in sorted(answer["choices"], key=lambda ch: ch["index"])]

    def abort(self) -> None:
        """End this run's requests still in flight on servers of your own (nothing else of theirs)."""
        by_server: dict = {}
        for rid, server in list(self.sent.items()):
            if server.proc is None:
                by_server.setdefault(id(server), (server, []))[1].append(rid)
        for server, rids in by_server.values():
            with contextlib.suppress(Exception):
                server.post("/inference/v1/abort_requests", {"request_ids": rids}, timeout=10)
