"""Reward fns for the e2e runs, loaded by dotted path (``tests.e2e.reward_fns.<name>``)."""


def response_length(prompt, response_text: str) -> float:
    """Varies within every group, so every step has advantages != 0 and moves the weights (a run with
    zero rewards never changes them: a stale engine would then be indistinguishable from a synced one)."""
    return min(len(response_text), 32) / 32.0
