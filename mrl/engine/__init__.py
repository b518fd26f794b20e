"""Everything that runs inside an SGLang server mrl starts, or starts, watches and stops one: the launcher
(CPU mode and GPUs), the patches and shims loaded into the server, the run's engine keys, the restarter,
and the one engine type every other process uses (``endpoint.EngineEndpoint``)."""
