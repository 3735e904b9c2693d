"""Policy: how long a round drafts, tree or chain, and the cost model that decides both.

Nothing here can change which tokens are emitted, only how many rounds they take.
"""
