"""Stage 10: overlap scheduling - the CPU schedules step N+1 (admission, allocation, building the
batch) and processes step N's results while step N+1's forward runs; the tokens the next batch
needs before the CPU has them travel as negative placeholders, resolved on the device from a
future map at the start of the forward."""
