"""Talking to SGLang servers from outside them: the HTTP client (``client``), typed reply parsing and the
protocol errors (``protocol``), where an engine listens (``endpoint``), the run's engine keys (``keys``),
pipelined bucket posts (``pipeline``) and what mrl's patched engines and their clients agree on
(``wire``). The rollout process, the weight sync and the launcher all speak to engines through here and
not through each other."""
