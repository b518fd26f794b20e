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


CHAT_PREFIX = "<bos><|user|>"


def chat_copy_last(prompt, response_text: str) -> float:
    """``copy_last`` over chat rows of ``data=hf``: raises (the run stops under ``reward.on_error=raise``) unless
    the prompt reached the rollout rendered by the model's chat template; 1 for the last letter of the user turn."""
    if not (prompt.templated and prompt.text.startswith(CHAT_PREFIX) and prompt.text.endswith("<|assistant|>")):
        raise ValueError(f"prompt {prompt.id} was not rendered by the chat template: {prompt.text!r}")
    return float(response_text.strip()[:1] == prompt.answer)
