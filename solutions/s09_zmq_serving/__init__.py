"""Stage 9: serving - an OpenAI-compatible HTTP server in front of the engine, split into four
processes joined by ZMQ: the API server (HTTP + SSE), the tokenizer worker, the scheduler (which
owns the engine and steps it) and the detokenizer worker (incremental, UTF-8 safe, stop strings
held back until they are decided)."""
