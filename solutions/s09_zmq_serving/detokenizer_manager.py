"""``DetokenizerManager``: the process that turns the scheduler's token ids into the text each
client may see now.

Per request it keeps a ``DecodeStatus``: stage 2's ``IncrementalDetokenizer`` (a few tokens
decoded per step, never half a UTF-8 character) plus how much text was already sent. Two rules
decide what goes out:

- **Never a broken character.** A byte-level tokenizer spells "é" in two tokens; after the first
  the incremental detokenizer releases nothing, so nothing is sent.
- **Never text that later turns out to be a stop string.** With stop=["\\n\\nUser:"] and released
  text "Sure!\\n\\nUs", the tail "\\n\\nUs" may become the stop string (then it is trimmed) or not
  (then it is text). Until that is decided the tail is **held back**::

        released:   S u r e ! \\n \\n U s
        sent:       S u r e !                    held back: the longest tail that is the start of a stop string

  When a stop string is complete it is cut out with everything after it; when the request ends
  any other way the held-back tail is sent.

The final text is built exactly as the offline engine's ``Req.output_text`` builds it, so a
streamed answer, joined, equals ``engine.generate(...)[i].text``.
"""

from __future__ import annotations

import logging

import zmq

from s00_foundation.tokenizer import Tokenizer
from s02_request_and_sampling.detokenizer import Decoder, IncrementalDetokenizer
from s02_request_and_sampling.req import FinishReason, find_stop_str

from .io_struct import BatchStrOut, BatchTokenIDOut, DebugFaultReq, DebugStateOut, ErrorOut, LogprobEntry
from .logprob_stream import LogprobStream, echo_prompt
from .worker_loop import Fault, serve_messages

logger = logging.getLogger(__name__)


def stop_hold_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` could still be the start of a stop string:
    the longest proper prefix of some stop string that ``text`` ends with (0 if none)."""
    # BEGIN EXERCISE: how many trailing characters might start a stop string
    # [#text-a-client-may-see-utf-8-and-stop-strings-detokenizer_managerpy]
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
    # END EXERCISE


class DecodeStatus:
    """One request's detokenization: its ids so far, the released text, what was sent."""

    def __init__(self, tokenizer: Decoder, stops: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = list(stops)
        self.output_ids: list[int] = []
        self.sent = 0  # characters of the final text already sent to the client
        self.stop_pos: int | None = None  # where the first complete stop string starts in the released text

    def step(self, new_ids: list[int], finish_reason: FinishReason | None) -> str:
        """Take one step's new token ids (and, on the last step, why the request ended); return
        the text the client may see now. Joined, the returned pieces are the request's final
        text: the released text, cut before a matched stop string (and a matched stop token /
        EOS is not text), with every other tail sent once the request is over."""
        # BEGIN EXERCISE: the new text a request may show, holding back what a stop string may take
        # [#text-a-client-may-see-utf-8-and-stop-strings-detokenizer_managerpy]
        self.output_ids += new_ids
        detok = self.detokenizer
        if finish_reason is not None and isinstance(finish_reason.matched, int):
            # The stop token / EOS is not text: the final text is everything before it.
            final = detok.flush(self.output_ids[:-1])
            return self._send_until(final, len(final))
        new_text = detok.step(self.output_ids) if self.output_ids else ""
        if self.stop_pos is None:
            hit = find_stop_str(detok.text, len(new_text), self.stops)
            if hit is not None:
                self.stop_pos = hit[0]
        if finish_reason is not None:
            if self.stop_pos is not None:
                final = detok.text[: self.stop_pos]
            else:
                final = detok.flush(self.output_ids)
            return self._send_until(final, len(final))
        text = detok.text
        safe = self.stop_pos if self.stop_pos is not None else len(text) - stop_hold_back(text, self.stops)
        return self._send_until(text, safe)
        # END EXERCISE

    def _send_until(self, text: str, end: int) -> str:
        """The part of ``text[:end]`` not sent yet (marked as sent)."""
        piece = text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece


class DetokenizerManager:
    """Reads ``BatchTokenIDOut`` from the scheduler, keeps a ``DecodeStatus`` per request, sends
    ``BatchStrOut`` to the API server; forwards errors, and adds its own counts to debug answers.

    A request whose text cannot be made (its decoding raised) gets an ``ErrorOut`` 500 and is
    forgotten; the others of the same step are not affected, and its later token ids (until the
    API server's abort reaches the scheduler) are dropped."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.decode_status: dict[str, DecodeStatus] = {}
        self.logprob_streams: dict[str, LogprobStream] = {}  # the requests that asked for log-probabilities
        self.failed: set[str] = set()  # rids answered with an error while the scheduler may still run them
        self.fault = Fault()

    def handle_batch_token_id_out(self, batch: BatchTokenIDOut) -> tuple[BatchStrOut, list[ErrorOut]]:
        out, errors = BatchStrOut([], [], [], [], [], []), []
        for i, rid in enumerate(batch.rids):
            reason = batch.finish_reasons[i]
            if rid in self.failed:
                if reason is not None:
                    self.failed.discard(rid)  # it ended in the scheduler too: nothing more will come
                continue
            try:
                text, logprobs = self.step_request(rid, batch, i)
            except Exception as error:
                logger.exception("decoding request %s failed; it gets an error, the others go on", rid)
                self.forget(rid)
                if reason is None:
                    self.failed.add(rid)
                errors.append(ErrorOut.internal(rid, error, "the detokenizer failed on this request"))
                continue
            if reason is not None:
                self.forget(rid)  # over
            if text or logprobs or reason is not None:
                out.rids.append(rid)
                out.texts.append(text)
                out.logprobs.append(logprobs)
                out.finish_reasons.append(None if reason is None else reason.type)
                out.prompt_tokens.append(batch.prompt_tokens[i])
                out.completion_tokens.append(batch.completion_tokens[i])
        return out, errors

    def step_request(self, rid: str, batch: BatchTokenIDOut, i: int) -> tuple[str, list[LogprobEntry]]:
        """Entry ``i`` of the batch through its request's DecodeStatus (and, if it asked for
        log-probabilities, its LogprobStream): the text and the entries to send now."""
        status = self.decode_status.get(rid)
        if status is None:
            status = self.decode_status[rid] = DecodeStatus(self.tokenizer, batch.stops[i])
        reason = batch.finish_reasons[i]
        if reason is not None and reason.type == "abort":
            return "", []
        self.fault.fire()
        new_ids, logprobs = batch.new_token_ids[i], batch.new_logprobs[i]
        echo = batch.echoes.get(rid)  # (with its first output only) the prompt goes first
        prompt, prompt_entries = ("", []) if echo is None else echo_prompt(self.tokenizer, echo)
        stream = self.logprob_streams.get(rid)
        if stream is None and logprobs:  # its first token: the request asked
            stream = self.logprob_streams[rid] = LogprobStream(self.tokenizer, base=len(prompt))
        if stream is None:
            return prompt + status.step(new_ids, reason), prompt_entries
        text, entries = stream.step(status, new_ids, logprobs, reason)
        return prompt + text, prompt_entries + entries

    def forget(self, rid: str) -> None:
        """The request is over, or ended in an error elsewhere (the scheduler's ErrorOut passes
        through here): drop what this process holds for it."""
        self.decode_status.pop(rid, None)
        self.logprob_streams.pop(rid, None)

    def debug_state(self) -> dict[str, int]:
        """What this process holds per request, for /debug/state: with nothing running all three are 0,
        else a request ended without its end reaching here (its text would be kept forever)."""
        return {
            "detokenizer_requests": len(self.decode_status),
            "detokenizer_logprob_streams": len(self.logprob_streams),
            "detokenizer_failed": len(self.failed),
        }


def run_detokenizer_process(server_args, ipc, ready, heartbeats) -> None:
    """The detokenizer process: PULL from the scheduler, PUSH to the API server, forever."""
    manager = DetokenizerManager(Tokenizer(server_args.model))
    context = zmq.Context()
    recv_from_scheduler = context.socket(zmq.PULL)
    recv_from_scheduler.bind(ipc.detokenizer)
    send_to_api = context.socket(zmq.PUSH)
    send_to_api.connect(ipc.api_server)

    def handle(message) -> None:
        if isinstance(message, BatchTokenIDOut):
            message, errors = manager.handle_batch_token_id_out(message)
            for error in errors:
                send_to_api.send_pyobj(error)
            if not message.rids:
                return
        elif isinstance(message, ErrorOut):
            manager.forget(message.rid)
        elif isinstance(message, DebugStateOut):  # the scheduler's counts, taken after every earlier message
            message.state.update(manager.debug_state())
        elif isinstance(message, DebugFaultReq):
            manager.fault.arm(message, "detokenizer")
            message = DebugStateOut(message.rid, {"armed": message.process, "kind": message.kind})
        send_to_api.send_pyobj(message)

    ready({})
    serve_messages("detokenizer", recv_from_scheduler, handle, send_to_api.send_pyobj, heartbeats)
