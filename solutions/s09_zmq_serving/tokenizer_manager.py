"""``TokenizerManager``: the process that turns text into token ids, off the scheduler's path.

Chat messages go through the model's chat template (text in them that spells a control token
stays text: ``s00 tokenizer.py``), a completion prompt is tokenized as it is (token ids are
checked and passed on); a chat's tools, and the calls and results in its history, go to a template
that knows tools, or are written into the messages for one that does not (``tool_calls.py``).
Aborts and debug questions pass through unchanged, on the same road as the requests, so they can
never overtake them. A prompt it cannot tokenize (no chat template, ids outside the vocabulary, a
``name`` the template would drop, a text longer than the model's context, found out a window at a
time: ``check_fits``) goes straight back to the API server as an ``ErrorOut`` (400); anything else
a request makes it raise is a fault of the server (500), and the worker goes on with the next
message (``worker_loop.py``).

(In SGLang the TokenizerManager lives inside the API server process and tokenizes on its event
loop; here it is a process of its own, so a long prompt's tokenization never stalls the HTTP side.)
"""

from __future__ import annotations

from typing import Any

import zmq
from jinja2 import TemplateError

from s00_foundation.config import ModelConfig
from s00_foundation.loader import resolve_model_path
from s00_foundation.tokenizer import Tokenizer, marker, marker_tag

from .io_struct import DebugFaultReq, ErrorOut, GenerateReqInput, TokenizedGenerateReqInput
from .tool_calls import chat_template_input
from .worker_loop import Fault, serve_messages

# Tokenized a window at a time, a text can count a few tokens more than it makes whole: a cut
# splits the token it falls in (or a control token's spelling), and may change the merges beside
# it (measured with SmolLM2's tokenizer on English, CJK, digits, spaces: at most 2 per cut). So a
# text is refused only when its count, less this much per cut, passes the context.
TOKENS_PER_CUT = 16


class PromptError(ValueError):
    """A prompt this tokenizer cannot serve; ``param`` is the request field at fault, ``code``
    OpenAI's error code (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class TokenizerManager:
    def __init__(self, tokenizer: Tokenizer, context_len: int):
        self.tokenizer = tokenizer
        self.context_len = context_len  # the model's own: no engine holds a longer prompt
        self.fault = Fault()
        # The longest token in characters: a text of more than context * this many characters
        # cannot fit the context whatever it says (for a byte-level tokenizer a character is at
        # least one byte and a token at most this many), so the API server refuses it untokenized.
        self.max_token_chars = max(len(token) for token in tokenizer.hf.get_vocab())

    def tokenize(self, req: GenerateReqInput) -> TokenizedGenerateReqInput:
        """Raises PromptError, ValueError or jinja2's TemplateError (a chat template that refuses
        the messages, e.g. roles that do not alternate): said to the client as a 400."""
        self.fault.fire()
        if req.messages is not None:
            messages, tools = chat_template_input(req.messages, req.tools, self.tokenizer.knows_tools)
            self.check_names_are_used(messages)
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, check_text=lambda text: self.check_fits(text, "messages")
            )
        elif req.text is not None:
            self.check_fits(req.text, "prompt")
            ids = self.tokenizer.encode(req.text)
            if not ids:  # "" (with no BOS token to add): nothing for the model to continue
                raise PromptError("prompt: the text makes no tokens at all; send some text", "prompt")
        else:
            ids = list(req.input_ids)
            vocab = self.tokenizer.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise PromptError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", "prompt")
        return TokenizedGenerateReqInput(req.rid, ids, req.sampling_params, req.fill_max_new_tokens, req.echo)

    def check_fits(self, text: str, param: str) -> None:
        """Refuse (PromptError) a prompt ``text`` that makes more tokens than the context, without
        tokenizing all of it. The API server's cap on characters cannot see this: a CJK character
        makes up to 3 tokens, so 660,000 of them (under the cap) made 1.8 million tokens and took
        the tokenizer 2 s, every other request waiting, only to be refused. Counted a window of
        ``context_len`` characters at a time, such a text passes the context in its first window.
        A text that fits is then tokenized whole, as before (its ids exact)."""
        window = self.context_len
        if len(text) <= window:  # one window: tokenizing it whole costs no more
            return
        count = 0
        for cuts, start in enumerate(range(0, len(text), window)):
            count += len(self.tokenizer.hf(text[start : start + window], add_special_tokens=False)["input_ids"])
            if count - cuts * TOKENS_PER_CUT > self.context_len:
                raise PromptError(
                    f"the prompt is longer than the model's context of {self.context_len} tokens: its first "
                    f"{min(start + window, len(text))} of {len(text)} characters already make more; it was "
                    "refused before the rest was tokenized",
                    param,
                    code="context_length_exceeded",
                )

    def check_names_are_used(self, messages: list[dict[str, Any]]) -> None:
        """A message's ``name`` must reach the prompt: rendered with a marker in place of each
        name, the template's text must hold every marker; a template that ignores names (most do)
        would drop them silently, so that is refused instead."""
        named = [i for i, message in enumerate(messages) if "name" in message]
        if not named or not self.tokenizer.is_chat:
            return  # (without a template apply_chat_template refuses the messages, saying why)
        tag = marker_tag()
        marked = [dict(m, name=marker(tag, i)) if "name" in m else m for i, m in enumerate(messages)]
        text = self.tokenizer.hf.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
        for i in named:
            if marker(tag, i) not in text:
                raise PromptError(
                    f"messages[{i}].name: this model's chat template does not use a message's name, "
                    "so it would be dropped; leave it out (or put it in the content)",
                    f"messages.{i}.name",
                )


def run_tokenizer_process(server_args, ipc, ready, heartbeats) -> None:
    """The tokenizer process: PULL from the API server, PUSH to the scheduler, forever."""
    folder = resolve_model_path(server_args.model)
    manager = TokenizerManager(Tokenizer(folder), ModelConfig.from_folder(folder).max_position_embeddings)
    context = zmq.Context()
    recv_from_api = context.socket(zmq.PULL)
    recv_from_api.bind(ipc.tokenizer)
    send_to_scheduler = context.socket(zmq.PUSH)
    send_to_scheduler.connect(ipc.scheduler)
    send_to_api = context.socket(zmq.PUSH)
    send_to_api.connect(ipc.api_server)

    def handle(message) -> None:
        if isinstance(message, GenerateReqInput):
            try:
                message = manager.tokenize(message)
            except (ValueError, TemplateError) as error:
                param = getattr(error, "param", "messages" if message.messages is not None else "prompt")
                send_to_api.send_pyobj(ErrorOut(message.rid, str(error), 400, param, getattr(error, "code", None)))
                return
        elif isinstance(message, DebugFaultReq):
            manager.fault.arm(message, "tokenizer")
        send_to_scheduler.send_pyobj(message)

    ready({"max_token_chars": manager.max_token_chars, "vocab_size": manager.tokenizer.vocab_size})
    serve_messages("tokenizer", recv_from_api, handle, send_to_api.send_pyobj, heartbeats)
