"""Process management for one engine replica's ranks: rank 0's handle on the workers it starts, and the workers' loop."""
