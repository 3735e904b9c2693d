"""The target's own prediction head (method="eagle"): corpus, cached features, training."""
