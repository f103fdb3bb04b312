"""``TokenizerManager``: the process that turns text into token ids, off the scheduler's path.

Chat messages go through the model's chat template, a completion prompt is tokenized as it is
(token ids are checked and passed on). Aborts and debug questions pass through unchanged, on the
same road as the requests, so they can never overtake them. A prompt it cannot tokenize (no chat
template, ids outside the vocabulary) goes straight back to the API server as an ``ErrorOut``.

(In SGLang the TokenizerManager lives inside the API server process and tokenizes on its event
loop; here it is a process of its own, so a long prompt's tokenization never stalls the HTTP side.)
"""

from __future__ import annotations

import zmq
from jinja2 import TemplateError

from s00_foundation.tokenizer import Tokenizer

from .io_struct import ErrorOut, GenerateReqInput, TokenizedGenerateReqInput


class TokenizerManager:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def tokenize(self, req: GenerateReqInput) -> TokenizedGenerateReqInput:
        """Raises ValueError or jinja2's TemplateError (a chat template that refuses the messages,
        e.g. roles that do not alternate): said to the client as a 400."""
        if req.messages is not None:
            ids = self.tokenizer.apply_chat_template(req.messages)
        elif req.text is not None:
            ids = self.tokenizer.encode(req.text)
        else:
            ids = list(req.input_ids)
            vocab = self.tokenizer.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return TokenizedGenerateReqInput(req.rid, ids, req.sampling_params, req.fill_max_new_tokens)


def run_tokenizer_process(server_args, ipc, ready) -> None:
    """The tokenizer process: PULL from the API server, PUSH to the scheduler, forever."""
    manager = TokenizerManager(Tokenizer(server_args.model))
    context = zmq.Context()
    recv_from_api = context.socket(zmq.PULL)
    recv_from_api.bind(ipc.tokenizer)
    send_to_scheduler = context.socket(zmq.PUSH)
    send_to_scheduler.connect(ipc.scheduler)
    send_to_api = context.socket(zmq.PUSH)
    send_to_api.connect(ipc.api_server)
    ready({})
    while True:
        message = recv_from_api.recv_pyobj()
        if isinstance(message, GenerateReqInput):
            try:
                message = manager.tokenize(message)
            except (ValueError, TemplateError) as error:
                param = "messages" if message.messages is not None else "prompt"
                send_to_api.send_pyobj(ErrorOut(message.rid, str(error), 400, param))
                continue
        send_to_scheduler.send_pyobj(message)
