"""Worker scripts run by the peers' own Pythons (peers.py), not imported by mini-infer."""
