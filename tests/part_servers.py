"""A server on loopback that sends the exact bytes of real streams with reasoning and tool calls,
which the embedded target only imitates: llama-server's ``reasoning_content`` (a thinking
model's tags counted in usage, never sent), vLLM's ``reasoning``, OpenAI's ``tool_calls``
deltas, Anthropic's thinking and ``tool_use`` blocks, Gemini's thought parts and
``functionCall``, the Responses API's reasoning summary and function call arguments; and
llama-server's ``/v1/messages`` answer of 31 text deltas for a usage of 32 (issue 31). Each
event is its own HTTP chunk, ``GAP_S`` apart, as uvicorn and llama-server send them.

``?case=`` picks the answer; ``serve()`` runs it in a thread of the test process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlsplit

from tests.stream_servers import ChunkedEvents, serve_in_thread

GAP_S = 0.002
THOUGHTS = ("The", " user", " asks", " about", " Paris", ".")        # reasoning: 6 events
ANSWER = (" It", " is", " sunny", " in", " Paris", " today", ",", " 21", " degrees", ".",
          " Enjoy", "!")                                               # answer: 12 events
ARGS = ('{"', "location", '":"', "Paris", '","', "unit", '":"', "celsius", '"}')   # 9 pieces


class Handler(ChunkedEvents):
    gap_s = GAP_S

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        url = urlsplit(self.path)
        case = parse_qs(url.query).get("case", ["reasoning"])[0]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if url.path.endswith("/messages"):
            self._anthropic(case)
        elif url.path.endswith("/responses"):
            self._responses(case)
        elif ":streamGenerateContent" in url.path:
            self._gemini(case)
        else:
            self._openai(case)
        self._end()

    # --- OpenAI chat: llama-server, vLLM, OpenAI ------------------------------------------------

    def _openai(self, case: str) -> None:
        """``reasoning``: llama-server with a thinking model (6 reasoning_content deltas, 12
        content deltas; usage 20 counts the closing tag and newline it never streams);
        ``vllm``: the same as vLLM sends it (``reasoning``); ``tool`` / ``tool-cut``: OpenAI's
        tool call, whole or cut by max_tokens inside its arguments."""
        rid = f"chatcmpl-{time.monotonic_ns()}"
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": "tiny", "system_fingerprint": "b1-0c1e570"}

        def chunk(delta: dict[str, object], finish: str | None = None) -> None:
            # llama-server's key order: choices first.
            self._event({"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
                         **base})

        chunk({"role": "assistant", "content": None})
        if case in ("reasoning", "vllm"):
            key = "reasoning_content" if case == "reasoning" else "reasoning"
            for piece in THOUGHTS:
                chunk({key: piece})
            for piece in ANSWER:
                chunk({"content": piece})
            chunk({}, "length")
            n = len(THOUGHTS) + 2 + len(ANSWER)
        else:
            chunk({"tool_calls": [{"index": 0, "id": "call_DdmNpKHhBjgOIcUi2cDeXXKp",
                                   "type": "function",
                                   "function": {"name": "get_weather", "arguments": ""}}]})
            args = ARGS if case == "tool" else ARGS[:5]
            for piece in args:
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            chunk({}, "tool_calls" if case == "tool" else "length")
            n = len(args) + 8
        self._event({"choices": [], **base, "usage": {
            "completion_tokens": n, "prompt_tokens": 18, "total_tokens": n + 18}})
        self._event(b"[DONE]")

    # --- Anthropic messages ---------------------------------------------------------------

    def _anthropic(self, case: str) -> None:
        """``thinking``: a thinking block, its signature, then text; ``tool`` / ``tool-cut``:
        thinking, then a tool_use block whose input_json_delta arguments close (or are cut by
        max_tokens); ``short``: llama-server's /v1/messages answer of 31 text deltas whose
        usage says 32."""
        def typed(obj: dict[str, object]) -> None:
            self._event(obj, str(obj["type"]))

        typed({"type": "message_start", "message": {
            "id": "msg_01YRxvSsvX3rP1WsZdiUPxZ9", "type": "message", "role": "assistant",
            "content": [], "model": "claude-sonnet-4-5", "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 18, "output_tokens": 1}}})
        index = 0
        if case != "short":
            typed({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "thinking", "thinking": ""}})
            for piece in THOUGHTS:
                typed({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "thinking_delta", "thinking": piece}})
            typed({"type": "content_block_delta", "index": 0, "delta": {
                "type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"}})
            typed({"type": "content_block_stop", "index": 0})
            index = 1
        if case in ("thinking", "short"):
            typed({"type": "content_block_start", "index": index,
                   "content_block": {"type": "text", "text": ""}})
            words = ANSWER if case == "thinking" else (ANSWER * 3)[:31]
            for piece in words:
                typed({"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": piece}})
            reason, n = "end_turn", len(words) + (len(THOUGHTS) if case == "thinking" else 1)
        else:
            typed({"type": "content_block_start", "index": 1, "content_block": {
                "type": "tool_use", "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6",
                "name": "get_weather", "input": {}}})
            typed({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "input_json_delta", "partial_json": ""}})
            args = ARGS if case == "tool" else ARGS[:5]
            for piece in args:
                typed({"type": "content_block_delta", "index": 1,
                       "delta": {"type": "input_json_delta", "partial_json": piece}})
            reason = "tool_use" if case == "tool" else "max_tokens"
            n = len(THOUGHTS) + len(args)
        typed({"type": "content_block_stop", "index": index})
        typed({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
               "usage": {"output_tokens": n}})
        typed({"type": "message_stop"})

    # --- Gemini, with includeThoughts -----------------------------------------------------

    def _gemini(self, case: str) -> None:
        """Thought parts (``thought: true``), the answer's text, and a last chunk with a
        ``functionCall`` part (``tool``) and the finish reason, as Gemini 2.5 sends them."""
        def chunk(parts: list[object], **extra: object) -> None:
            candidate = {"content": {"parts": parts, "role": "model"}, "index": 0, **extra}
            self._event({"candidates": [candidate], "usageMetadata": {
                "promptTokenCount": 18, "totalTokenCount": 18},
                "modelVersion": "gemini-2.5-flash", "responseId": "lcr0aKH4NYyxkdUPzLm8-Ak"})

        for piece in THOUGHTS:
            chunk([{"text": piece, "thought": True}])
        for piece in ANSWER[:6]:
            chunk([{"text": piece}])
        call = {"functionCall": {"name": "get_weather",
                                 "args": {"location": "Paris", "unit": "celsius"}},
                "thoughtSignature": "CiQB0e2Kb6t4"}
        self._event({"candidates": [{
            "content": {"parts": [call] if case == "tool" else [{"text": "."}],
                        "role": "model"}, "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 18, "candidatesTokenCount": 8,
                              "thoughtsTokenCount": 6, "totalTokenCount": 32},
            "modelVersion": "gemini-2.5-flash", "responseId": "lcr0aKH4NYyxkdUPzLm8-Ak"})

    # --- the Responses API: a reasoning model calling a function ---------------------------

    def _responses(self, case: str) -> None:
        """A reasoning item streamed as summary text, then a function call whose arguments
        close (``tool``: response.completed) or are cut by max_output_tokens (``tool-cut``:
        response.incomplete)."""
        seq = iter(range(1000))
        response = {"id": "resp_68af4030592c81938ec0a5fbab4a3e9f", "object": "response",
                    "created_at": int(time.time()), "status": "in_progress", "error": None,
                    "incomplete_details": None, "model": "o4-mini-2025-04-16", "output": [],
                    "usage": None}

        def typed(kind: str, **fields: object) -> None:
            self._event({"type": kind, "sequence_number": next(seq), **fields}, kind)

        rs, fc = "rs_68af4030baa48193b0b43b4c2a176a1a", "fc_68af40315a5c8193b1a1e6bd5d2d7c85"
        typed("response.created", response=response)
        typed("response.in_progress", response=response)
        typed("response.output_item.added", output_index=0,
              item={"id": rs, "type": "reasoning", "summary": []})
        typed("response.reasoning_summary_part.added", item_id=rs, output_index=0,
              summary_index=0, part={"type": "summary_text", "text": ""})
        for piece in THOUGHTS:
            typed("response.reasoning_summary_text.delta", item_id=rs, output_index=0,
                  summary_index=0, delta=piece, obfuscation="Q7c9")
        typed("response.reasoning_summary_text.done", item_id=rs, output_index=0,
              summary_index=0, text="".join(THOUGHTS))
        typed("response.output_item.done", output_index=0,
              item={"id": rs, "type": "reasoning", "summary": [
                  {"type": "summary_text", "text": "".join(THOUGHTS)}]})
        typed("response.output_item.added", output_index=1, item={
            "id": fc, "type": "function_call", "status": "in_progress", "arguments": "",
            "call_id": "call_vYkQ8mzpPyWPBkvDoTEd3Nc4", "name": "get_weather"})
        args = ARGS if case == "tool" else ARGS[:5]
        for piece in args:
            typed("response.function_call_arguments.delta", item_id=fc, output_index=1,
                  delta=piece, obfuscation="ZK")
        usage = {"input_tokens": 18, "output_tokens": len(THOUGHTS) + len(args),
                 "output_tokens_details": {"reasoning_tokens": len(THOUGHTS)},
                 "total_tokens": 18 + len(THOUGHTS) + len(args)}
        if case == "tool":
            typed("response.function_call_arguments.done", item_id=fc, output_index=1,
                  arguments="".join(args))
            typed("response.completed", response={**response, "status": "completed",
                                                  "usage": usage})
        else:
            typed("response.incomplete", response={
                **response, "status": "incomplete", "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"}})


@contextmanager
def serve() -> Iterator[str]:
    """The server on a free loopback port, in a thread of this process; yields its URL."""
    with serve_in_thread(Handler) as url:
        yield url
