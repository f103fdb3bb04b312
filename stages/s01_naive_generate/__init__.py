"""Stage 1: naive generation - recompute the whole sequence for every new token."""
