"""Stage 5: continuous batching - a scheduler that admits waiting requests under a token budget,
runs prefills and decodes in one ragged batch, retires finished requests every step and
retracts the newest ones when the KV pool runs dry."""
