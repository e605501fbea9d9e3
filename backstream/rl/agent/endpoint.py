"""An OpenAI-compatible endpoint for agent programs (issue 34, docs/agentic.md): `POST
/v1/chat/completions` (messages, tools and tool_choice, streaming or not) and `GET /v1/models`, on
127.0.0.1 only, served by FastAPI on uvicorn (vLLM's own stack), requests validated by typed models.

Each episode has its own base URL (`/episodes/<id>/v1`) and key; a request with another key, or for
a finished episode, is refused. A request's conversation is rendered whole (the model's chat template
with the request's tools, or the plain format of a model without one: rl/agent/turns.py) and handed
to the episode's `Transcript` (rl/agent/transcript.py), which continues a branch or starts one; the
answer is sampled after exactly those ids (`generate`: the run's backend, token ids in and out) and
recorded with its log-probs. Tool calls in the answer are parsed (the formats the project reads) into
OpenAI `tool_calls`, with `finish_reason` "tool_calls".

Honoured: `model` (the served name), `messages`, `tools`, `tool_choice` ("auto", "none": no call is
parsed; "required" or a named function are taken as "auto": the policy samples freely, nothing forces
a call), `stream`, `max_tokens` / `max_completion_tokens` (at most rollout.max_new_tokens), `seed`.
Refused with an OpenAI-shaped error the client reads: `tools` that the chat template renders no trace of
(400, code "tools_not_rendered": rendered with and without them, the prompt is the same, as with
SmolLM2's template, which has no `tools` variable; the plain format writes no schema by design),
malformed JSON or fields (400), another key
(401), a finished episode (403), an unknown model (404), a body over `MAX_BODY` bytes (413), `n` > 1,
`temperature` / `top_p` other than the run's (the policy is trained at its own sampling settings),
more requests than `max_requests` (400). A conversation that leaves no room in the model's context
answers nothing with `finish_reason` "length".

Images (a vision-language policy, `vision`): a message's `image_url` parts with data URLs
("data:image/png;base64,...") are the policy's images: each is read and processed (rl/data/images.py
`Pictures`), rendered as the template's image part and expanded over its placeholders, and the ids
handed on hold its positions as the round's virtual ids (rl/backends/local/gallery.py), so a history
that re-sends an earlier screenshot extends the branch that holds it. An http(s) URL is refused (400
naming the part: the run fetches nothing from the network), so is an image part for a text policy.
"""

import asyncio
import concurrent.futures
import json
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from backstream.rl.agent.transcript import Transcript
from backstream.rl.records import Completion

MAX_BODY = 4 * 2**20  # bytes of one request
TOOLS_DROPPED = "tools_not_rendered"  # the error code of a request whose tools the chat template dropped


def tools_dropped(fmt) -> str:
    """What a request whose tools the chat template renders no trace of is told (and the run says once)."""
    names = ", ".join(s["function"]["name"] for s in fmt.schemas)
    return (f"the request's tools ({names}) are not in the prompt: {fmt.source} renders the conversation the same "
            "with their schemas as without (it has no `tools` variable), so the policy would never see them. Use a "
            "template that renders tools (env.chat_template = a .jinja file or the template text, e.g. Qwen3's), "
            "or data.format / env.format = \"plain\" with the tools written into the prompt")
MAX_IN_FLIGHT = 1024  # requests answered at once (more wait their turn)


@dataclass
class EpisodeSession:
    """One episode of an agent program: its key, its transcript, whether it is over."""

    id: str
    key: str
    base_url: str
    seed: int = 0  # a request without `seed` draws with seed (this, its number in the episode)
    generate: Callable | None = None  # (ids, max_tokens, seed, session) -> Completion: what samples its requests
    images: Any = None  # its round's `Gallery` (a VLM on the in-process sampler): its requests' images
    transcript: Transcript = field(default_factory=Transcript)
    finished: bool = False
    errors: int = 0  # requests refused
    refused: dict = field(default_factory=dict)  # requests refused, by error code (None: no code)
    tool_calls: int = 0  # calls answered

    @property
    def conversation(self) -> list[dict]:
        """The last answered request's messages and its answer (what the reward functions see)."""
        return self.transcript.conversation


class APIError(Exception):
    """An error the client gets in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _models():
    """The request's typed models (pydantic, as FastAPI validates them)."""
    from pydantic import BaseModel, ConfigDict, Field  # noqa: PLC0415  (the endpoint's extra)

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: str | list[dict[str, Any]] | None = None
        tool_calls: list[dict[str, Any]] | None = None
        tool_call_id: str | None = None
        name: str | None = None

    class ChatRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: str
        messages: list[Message] = Field(min_length=1)
        tools: list[dict[str, Any]] | None = None
        tool_choice: str | dict[str, Any] | None = None
        stream: bool = False
        n: int = 1
        temperature: float | None = None
        top_p: float | None = None
        max_tokens: int | None = Field(default=None, ge=1)
        max_completion_tokens: int | None = Field(default=None, ge=1)
        seed: int | None = None

    return ChatRequest


class Endpoint:
    """The endpoint of a run (see the module docstring). `format_for(tools)`: a turn format
    (rl/agent/turns.py) for a request's tools, which renders a conversation (`conversation`) and parses
    an answer (`parse`); `generate(ids, max_tokens, seed)`: the backend's sample after `ids`;
    `eos`: the token that ends a turn; `temperature` / `top_p` / `max_new_tokens`: the run's sampling;
    `context`: the model's; `max_requests`: per episode (env.max_turns); `vision`: a VLM policy's
    `Pictures` (its requests' image parts, the module docstring)."""

    def __init__(self, format_for: Callable, generate: Callable[..., Completion], eos: int,
                 served_name: str = "policy", temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, context: int | None = None, max_requests: int = 16, vision=None):
        self.format_for, self.generate, self.eos, self.served_name = format_for, generate, eos, served_name
        self.vision = vision  # a vision-language policy's `Pictures` (rl/data/images.py): image parts taken
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.context, self.max_requests = context, max_requests
        self.episodes: dict[str, EpisodeSession] = {}
        self.dropped = ""  # what the last request whose tools the template dropped was told (`tools_dropped`)
        self.finished: dict[str, str] = {}  # finished episodes' keys
        # a thread per request in flight (the backend's `generate` blocks until its batch is decoded):
        # asyncio's default pool (cores + 4 threads) would let only that many episodes batch
        self.workers = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT,
                                                             thread_name_prefix="backstream-request")
        self.lock = threading.Lock()
        self.server = None  # uvicorn's, once started
        self.thread: threading.Thread | None = None
        self.url = ""
        self.app = self._app()

    # -- the run's side --------------------------------------------------------------------------
    def start(self) -> str:
        """Serve on 127.0.0.1, a free port, in a thread; returns the URL once it answers."""
        import uvicorn  # noqa: PLC0415  (the endpoint's extra)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="backstream-endpoint", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on 127.0.0.1:{port}")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
            self.server = None
        self.workers.shutdown(wait=False, cancel_futures=True)

    def open(self, seed: int = 0, generate: Callable | None = None, images=None) -> EpisodeSession:
        """A new episode: its base URL and key (what its agent is given); `seed`: its requests' draws;
        `generate`: what samples its requests (default: the endpoint's); `images`: its round's
        `Gallery`, where a VLM's requests may hold images."""
        eid = uuid.uuid4().hex[:16]
        ep = EpisodeSession(id=eid, key=f"bs-{secrets.token_urlsafe(24)}", base_url=f"{self.url}/episodes/{eid}/v1",
                            seed=seed, generate=generate or self.generate, images=images)
        with self.lock:
            self.episodes[eid] = ep
        return ep

    def finish(self, ep: EpisodeSession) -> Transcript:
        """The episode is over: later requests are refused, and answers still being sampled are not
        recorded; its transcript."""
        ep.finished = True
        ep.transcript.close()
        with self.lock:  # a finished episode's key is kept (its requests are refused as finished), not its data
            self.episodes.pop(ep.id, None)
            self.finished[ep.id] = ep.key
        return ep.transcript

    # -- the HTTP side ---------------------------------------------------------------------------
    def _app(self):
        from fastapi import FastAPI, Request  # noqa: PLC0415  (the endpoint's extra)
        from fastapi.responses import JSONResponse, StreamingResponse  # noqa: PLC0415
        from pydantic import ValidationError  # noqa: PLC0415

        app = FastAPI(title="backstream agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        chat_request = _models()

        def episode_of(request: Request, eid: str) -> EpisodeSession:
            ep = self.episodes.get(eid)
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            key = ep.key if ep is not None else self.finished.get(eid)
            if key is None or not secrets.compare_digest(given, key):
                raise APIError(401, "Incorrect API key for this episode: use the OPENAI_API_KEY the run gave "
                                    "the agent, with its OPENAI_BASE_URL", "authentication_error",
                               code="invalid_api_key")
            if ep is None or ep.finished:
                raise APIError(403, "this episode is over: its requests were trained; a new episode gets a new base "
                                    "URL and key", "permission_error", code="episode_finished")
            return ep

        @app.exception_handler(APIError)
        async def api_error(_request, e: APIError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(Exception)
        async def server_error(_request, e: Exception):  # the backend failed (a server that died): said, shaped
            return JSONResponse(APIError(500, f"the run's sampler failed: {type(e).__name__}: {e}", "server_error")
                                .body(), status_code=500)

        @app.get("/episodes/{eid}/v1/models")
        async def models(request: Request, eid: str):
            episode_of(request, eid)
            return {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": 0,
                                                "owned_by": "backstream"}]}

        @app.post("/episodes/{eid}/v1/chat/completions")
        async def chat(request: Request, eid: str):
            ep = episode_of(request, eid)
            body = await request.body()
            if len(body) > MAX_BODY:
                raise APIError(413, f"the request is {len(body)} bytes, over the endpoint's limit of {MAX_BODY}",
                               code="request_too_large")
            try:
                req = chat_request.model_validate_json(body)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first.get("loc", ()))
                raise APIError(400, f"{first.get('msg', 'invalid request')} ({where or 'body'})",
                               param=where or None) from None
            answer = await asyncio.get_running_loop().run_in_executor(self.workers, self._complete, ep, req)
            if not req.stream:
                return answer
            return StreamingResponse(_chunks(answer), media_type="text/event-stream")

        return app

    def _complete(self, ep: EpisodeSession, req) -> dict:
        """One chat completion (in a worker thread: the backend's `generate` blocks)."""
        try:
            self._check(ep, req)
            messages, pictures = [], []
            for i, m in enumerate(req.messages):
                message, pics = _for_template(m.model_dump(exclude_none=True), i, self.vision)
                messages.append(message)
                pictures += pics
            fmt = self.format_for((req.tools or []) if req.tool_choice != "none" else [])
            if fmt.renders_tools and fmt.drops_tools(messages):
                self.dropped = tools_dropped(fmt)
                raise APIError(400, self.dropped, param="tools", code=TOOLS_DROPPED)
            ids = fmt.conversation(messages, self.eos)
            if self.vision is not None:
                ids = self._images(ep, ids, pictures)
        except APIError as e:
            ep.errors += 1
            ep.refused[e.code] = ep.refused.get(e.code, 0) + 1
            raise
        number = ep.transcript.requests
        branch = ep.transcript.request(ids)
        room = (self.context - len(ids)) if self.context else self.max_new_tokens
        budget = min(req.max_completion_tokens or req.max_tokens or self.max_new_tokens, self.max_new_tokens, room)
        if budget <= 0:
            out = Completion([], torch.empty(0), torch.empty(0, dtype=torch.long), "length")
        else:
            seed = req.seed if req.seed is not None else (ep.seed * 1_000_003 + number) % 2**31
            out = ep.generate(ids, budget, seed, ep.id)  # the episode's session: one server of a pool
        message, calls = fmt.parse(out.ids) if out.ids else ({"role": "assistant", "content": ""}, [])
        calls = [c for c in calls if c.error is None]  # a malformed call is text the agent reads
        finish = "length" if out.reason == "length" else "tool_calls" if calls else "stop"
        reply: dict = {"role": "assistant", "content": message.get("content") or None}
        if calls and out.reason != "length":
            reply["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                   for c in calls]
        elif message.get("tool_calls") or not reply["content"]:  # a malformed call: its text as the agent's
            reply["content"] = fmt.tok.decode(out.ids, skip_special_tokens=True)
        # the answer and the conversation the rewards will see, recorded together (or neither, once over)
        if not ep.transcript.answer(branch, out.ids, out.logprobs.tolist(), out.versions.tolist(),
                                    [*messages, {**reply, "finish_reason": finish}]):
            raise APIError(403, "this episode ended while its answer was sampled (env.agent_timeout_s); it is not "
                                "trained", "permission_error", code="episode_finished")
        ep.tool_calls += len(reply.get("tool_calls", []))
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name,
                "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out.ids),
                          "total_tokens": len(ids) + len(out.ids)}}

    def _images(self, ep: EpisodeSession, ids: list[int], pictures: list) -> list[int]:
        """A VLM's rendered conversation with each image token over its placeholders, its images'
        positions as the round's virtual ids (the module docstring)."""
        from backstream.checks import UserError  # noqa: PLC0415

        try:
            ids, at = self.vision.expand(ids, pictures, "messages")
            if not pictures:
                return ids
            if ep.images is None:
                raise UserError("messages: images need the in-process sampler (rollout.backend = \"local\")")
            return ep.images.virtual(ids, pictures, at, "messages")
        except UserError as e:
            raise APIError(400, str(e), param="messages") from None

    def _check(self, ep: EpisodeSession, req) -> None:
        if req.model != self.served_name:
            raise APIError(404, f"The model {req.model!r} does not exist: this endpoint serves {self.served_name!r} "
                                "(OPENAI_MODEL)", code="model_not_found", param="model")
        if req.n != 1:
            raise APIError(400, f"n = {req.n}: one completion per request (a group's G episodes are the run's "
                                "samples of a task)", param="n")
        for name, run in (("temperature", self.temperature), ("top_p", self.top_p)):
            value = getattr(req, name)
            if value is not None and value != run:
                raise APIError(400, f"{name} = {value}: the run samples at rollout.{name} = {run}, the policy's "
                                    f"trained setting; leave {name} unset", param=name)
        if ep.transcript.requests >= self.max_requests:
            raise APIError(400, f"this episode has made its {self.max_requests} requests (env.max_turns)",
                           code="max_turns")


def _for_template(message: dict, index: int, vision=None) -> tuple[dict, list]:
    """An OpenAI message as chat templates take it, and the images it holds: content parts
    ([{"type": "text", "text": …}]) as one string, a call's arguments as an object. For a
    vision-language policy (`vision`), `image_url` parts with data URLs are images (the parts kept,
    each image a `{"type": "image"}` the template renders); any other content (an image for a text
    policy, a message nested as content) is refused: a text template would render it as Python's repr
    of the list."""
    content = message.get("content")
    pictures = []
    if isinstance(content, list) and vision is not None and any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "image_url":
                pictures.append(_picture(p, vision, f"messages[{index}].content[{j}]"))
                parts.append({"type": "image"})
            elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            else:
                raise APIError(400, f"messages[{index}].content[{j}]: a part {str(p)[:80]} is neither a text nor an "
                                    "image_url part", param=f"messages[{index}].content[{j}]")
        message = {**message, "content": parts}
    elif isinstance(content, list):
        bad = [p for p in content
               if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))]
        if bad:
            raise APIError(400, f"messages[{index}].content: a part {str(bad[0])[:80]} is not a text part "
                                "({\"type\": \"text\", \"text\": ...}); this endpoint serves a text model (images "
                                "need a vision-language policy and env.images = true): send the "
                                "content as a string or as text parts (a row's chat prompt is a list of messages: "
                                "pass it as `messages`, not as one message's content)",
                           param=f"messages[{index}].content")
        message = {**message, "content": "".join(p["text"] for p in content)}
    calls = message.get("tool_calls")
    if calls:
        fixed = []
        for c in calls:
            fn = dict(c.get("function", {}))
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"] or "{}")
                except ValueError:
                    pass  # kept as sent: the template renders what the agent wrote
            fixed.append({**c, "function": fn})
        message = {**message, "tool_calls": fixed}
    return message, pictures


def _picture(part: dict, vision, where: str):
    """An `image_url` part's image as the policy's processor makes it (a data URL only)."""
    from backstream.checks import UserError  # noqa: PLC0415

    url = part.get("image_url")
    url = url.get("url", "") if isinstance(url, dict) else str(url or "")
    try:
        return vision.from_url(url, where)
    except UserError as e:
        raise APIError(400, str(e).removeprefix("data: "), param=where) from None


def _chunks(answer: dict):
    """A completion as server-sent events: the message in one chunk, the finish reason, [DONE]."""
    choice = answer["choices"][0]
    base = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if choice["message"].get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
    yield f"data: {json.dumps(base | {'choices': [{'index': 0, 'delta': delta, 'finish_reason': None}]})}\n\n"
    end = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    yield f"data: {json.dumps(base | {'choices': [end]})}\n\n"
    yield "data: [DONE]\n\n"
