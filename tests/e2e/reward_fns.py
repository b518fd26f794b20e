"""Reward fns for the e2e runs, loaded by dotted path (``tests.e2e.reward_fns.<name>``)."""


def response_length(prompt, response_text: str) -> float:
    """Varies within every group, so every step has advantages != 0 and moves the weights (a run with
    zero rewards never changes them: a stale engine would then be indistinguishable from a synced one)."""
    return min(len(response_text), 32) / 32.0


def text_parity(prompt, response_text: str) -> float:
    """Prompts whose text has a length divisible by 3 get 0 whatever the answer (groups without signal, for
    DAPO's dynamic sampling to skip); the others 1 for an odd number of characters (signal in most groups)."""
    if len(prompt.text) % 3 == 0:
        return 0.0
    return float(len(response_text) % 2)
