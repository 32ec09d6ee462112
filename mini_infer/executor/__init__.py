"""How one engine replica runs its model: in-process or over ranks (executor.py), and the rank processes
(ranks.py: rank 0's handle on the workers it starts, and the workers' loop)."""
