"""Stage 11: structured output - a grammar (a JSON schema or a regex) compiled in the background
turns into a token bitmask before each sampling step, so every output parses by construction."""
