"""`mini-infer bench`, `profile` and `bench-serve`: mini-infer against HF transformers baselines on the same
weights, prompts and threads (fixed, random), its scheduler features (shared-prefix, long-prompt), its parallel
layouts, a decode step's breakdown, and a running server's load test."""
