"""flexmesh's router speaking to an engine it did not write (vLLM, SGLang): OpenAI's completions API, streamed.

flexmesh's own engine answers with each token's time (``metrics.token_s``) and stops a request on
``POST /cancel``. A production engine does neither, so the router asks it for a stream
(``"stream": true``, vLLM's ``"return_token_ids": true`` for the tokens) and times each token as its chunk
arrives -- what vLLM's own ``benchmark_serving`` measures, a client's TTFT and TPOT -- and stops a request by
closing its connection, which vLLM and SGLang treat as an abort. The answer is then built in the shape flexmesh's
engine gives (:func:`flexmesh.serve.engine.server.completion_body`), so that records, branches and failures are
handled alike whichever engine answered.

One chunk of vLLM's stream (server-sent events; ``data: [DONE]`` ends it)::

    data: {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "",
           "token_ids": [917], "finish_reason": null}]}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

PROTOCOLS = ("flexmesh", "openai")  # how the router speaks to an engine: flexmesh's own, or a streamed OpenAI API


def stream_body(body: dict, max_tokens: int, model: str | None) -> dict:
    """The streamed request an OpenAI-compatible engine is sent for the client's ``body`` (flexmesh's fields
    dropped): greedy, ``max_tokens`` long, token ids asked back.

    >>> stream_body({"prompt": [1, 2], "max_tokens": 9, "request_id": "3.0.1"}, 4, "m")["max_tokens"]
    4
    >>> sorted(stream_body({"prompt": [1], "model": "x"}, 4, "m"))
    ['max_tokens', 'model', 'prompt', 'return_token_ids', 'stream', 'temperature']
    """
    out = {k: v for k, v in body.items() if k not in ("request_id", "n", "needed", "branch_tokens", "metrics")}
    out.update(max_tokens=max_tokens, stream=True, return_token_ids=True, temperature=out.get("temperature") or 0)
    if model is not None:
        out.setdefault("model", model)
    return out


@dataclass
class Streamed:
    """What one streamed completion brought: its token ids and when each arrived (perf_counter seconds)."""

    sent_s: float
    tokens: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # the stream ended with [DONE]

    def add(self, line: bytes, now: float | None = None) -> None:
        """One line of the event stream (others than ``data:`` are ignored); a chunk without token ids is an
        engine not asked for them: a ValueError naming the flag."""
        text = line.decode("utf-8", errors="replace").strip()
        if not text.startswith("data:"):
            return
        data = text[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"the engine's stream carried an error: {str(chunk['error'])[:200]}")
        now = time.perf_counter() if now is None else now
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids")
            if ids is None:
                if choice.get("text"):
                    raise ValueError("the engine streams text without token ids: flexmesh asks for "
                                     "return_token_ids (vLLM 0.10.2 or later)")
                ids = []
            self.tokens.extend(ids)
            self.token_s.extend([now] * len(ids))  # tokens of one chunk arrived together
            self.text += choice.get("text") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def answer(self, model: str, prompt_tokens: int, cancelled: bool) -> dict:
        """The answer in flexmesh's engine's shape (see the module doc)."""
        finish = "abort" if cancelled else (self.finish_reason or "length")
        return {"id": "cmpl-streamed", "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "text": self.text, "token_ids": self.tokens, "logprobs": None,
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(self.tokens),
                          "total_tokens": prompt_tokens + len(self.tokens)},
                "metrics": {"queued_s": self.sent_s, "started_s": None, "token_s": self.token_s}}
