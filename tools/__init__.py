"""Course machinery: skeleton generator, implementation switch, fail-proof, grader, setup."""
