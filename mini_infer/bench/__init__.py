"""`mini-infer bench`: mini-infer against HF transformers baselines on the same weights, prompts and threads.

`fixed` sweeps batch sizes against the machine's roofline; `random` serves requests of random lengths.
"""
